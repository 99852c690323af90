"""What a pooling request asks for (vLLM's PoolingParams): the pooled vector of its prompt, made into an embedding
or a classifier's probabilities. The sampling side's counterpart is SamplingParams."""
from __future__ import annotations

from dataclasses import dataclass

POOLING_TASKS = ("embed", "classify")


@dataclass(frozen=True)
class PoolingParams:
    """`task`: embed (the pooled hidden state, as the model's pooler config says) or classify (the classifier's
    probabilities; a single-label classifier's one score). `dimensions`: a Matryoshka model's embedding cut to its
    first N values (then normalised again). `normalize` / `use_activation`: None takes the model's default."""

    task: str = "embed"
    dimensions: int | None = None
    normalize: bool | None = None
    use_activation: bool | None = None

    def __post_init__(self) -> None:
        if self.task not in POOLING_TASKS:
            raise ValueError(f"task must be one of {', '.join(POOLING_TASKS)}; got {self.task!r}.")
        if self.dimensions is not None and (isinstance(self.dimensions, bool) or not isinstance(self.dimensions, int)
                                            or self.dimensions < 1):
            raise ValueError(f"dimensions must be an integer >= 1, got {self.dimensions!r}.")
        if self.dimensions is not None and self.task != "embed":
            raise ValueError("dimensions applies to embeddings (task 'embed') only.")
