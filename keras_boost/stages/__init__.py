"""One boost feature per module: its pure function and its stage."""
