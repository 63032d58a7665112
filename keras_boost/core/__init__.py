"""The bottom layer: the stage contract and the store of the boost state.

Everything above may import these; they import nothing of keras_boost but `_validation` and
`_keras_compat` (docs/architecture.md, checked by tests/test_layout.py).
"""
