"""Running a step on the device: model set-up, the runner, CUDA graphs, step inputs, memory."""
