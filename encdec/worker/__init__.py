"""Step execution: the worker, the model runner and its input batch, CUDA graphs, the KV cache tensors."""
