"""The model: `ModelConfig` from an artifact component, weight bindings, the NumPy reference
forward (oracle and CPU backend) and the CUDA model runner, both behind the `ModelRunner`
protocol the engine uses."""
