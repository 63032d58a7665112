"""Rewrites of functional Keras graphs: LessBN and the FN head."""
