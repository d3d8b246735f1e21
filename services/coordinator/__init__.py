"""The coordinator gateway: coordinator episodes under a swappable endpoint, branch dispatch to
workers, durable records (`bcstack serve coordinator`)."""
