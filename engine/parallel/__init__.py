"""Tensor parallelism: a model split over ranks; rank 0 schedules, the others follow."""
