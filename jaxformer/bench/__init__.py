"""`jaxformer bench`: the train step timed on synthetic batches (`step`), the model FLOPs and device peaks its MFU
divides (`flops`), and its PyTorch peer (`torch_peer`)."""
