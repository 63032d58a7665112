"""Reports the GPUs a worker sees after `distributed.init()` (none on a CPU machine)."""

from common import report

import tensorflow as tf

from keras_boost import distributed

distributed.init()
caps = distributed.capabilities()
x = tf.ones([64, 64])
report(distributed.rank(), local_rank=distributed.local_rank(), local_size=distributed.local_size(),
       physical=len(tf.config.list_physical_devices("GPU")),
       visible=[d.name for d in tf.config.get_visible_devices("GPU")],
       logical=[d.name for d in tf.config.list_logical_devices("GPU")],
       pinning=caps["gpu_pinning"], gpu_allreduce=caps["gpu_allreduce"], nccl_built=caps["nccl_built"],
       placed_on=(x @ x).device, sum=float(distributed.allreduce(tf.reduce_sum(x), average=False).numpy()))
