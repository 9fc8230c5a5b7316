"""Writers of the artifacts other servers load."""
