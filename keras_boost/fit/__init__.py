"""What keras_boost adds around Keras' `fit` on many workers, above the door to Horovod.

- `callbacks`: Horovod's Keras callbacks for Keras 3 (broadcast, metric and BatchNorm
  averaging, learning-rate warm-up, `BackupAndRestore`, rank-0-only) and the boost
  scalars' logging; public as `keras_boost.callbacks`;
- `elastic`: elastic training (state, commits, `run`); public as `keras_boost.elastic`;
- `dropin`: a script written for one machine, on many (one writer per file, progress lines
  under a launcher, the distributed optimizer);
- `data_sync`: the checks that the workers agree when `fit` starts (versions, configuration,
  data) and that their data is sharded;
- `watchdog`: ends a `fit` whose workers stopped together, naming who is where.

These modules reach Horovod through `keras_boost.distributed` alone.
"""
