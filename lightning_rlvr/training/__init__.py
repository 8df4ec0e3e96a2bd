"""The parts of a training step, each in its own file; :class:`~lightning_rlvr.module.RLVRModule` wires them.

- :mod:`~lightning_rlvr.training.loading`: the policy, the frozen reference, their sharding, the optimizer.
- :mod:`~lightning_rlvr.training.versions`: which policy a rollout may come from; settings checked at fit start.
- :mod:`~lightning_rlvr.training.token_stats`: log-probs and entropy of completions under a model.
- :mod:`~lightning_rlvr.training.hooks`: the interventions' hooks, called in list order.
- :mod:`~lightning_rlvr.training.update`: minibatches, micro-batches, the loss of a micro-batch, the gradient's path.
- :mod:`~lightning_rlvr.training.stats`: the step's sums, its metrics and the loggers.
"""
