"""MindSpore's names and flows in Keras form: AutoBoost's network_auto_process_*, OptimizerProcess, ParameterProcess, and the callable cells (BoostTrainOneStep, GradientAccumulation, AdaSum)."""
