"""The demo application: the keras-boost command, its recipes, benchmarks, data readers and the demo network. No library logic."""
