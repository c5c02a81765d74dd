"""`jaxformer bench`: the train step timed on synthetic batches (`step`), and its PyTorch peer (`torch_peer`)."""
