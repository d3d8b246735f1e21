"""browsecomp-stack: serve, evaluate and train small BrowseComp research workers."""

__version__ = "0.1.0"
