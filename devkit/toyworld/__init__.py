"""The toy world: a deterministic fictional corpus and questions in the BrowseComp-Plus formats."""
