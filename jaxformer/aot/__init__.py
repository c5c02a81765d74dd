"""`jaxformer compile`: ahead-of-time compilation for meshes, TPU topologies and GPUs this machine does
not have: the train step (`train_step`), decoding (`decode`), and deviceless GPU targets (`gpu`)."""
