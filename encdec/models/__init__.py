"""The models in plain PyTorch, their shared layers, the registry and the HF and CTranslate2 loaders."""
