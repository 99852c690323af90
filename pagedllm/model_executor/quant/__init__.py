"""Checkpoints that arrive quantized (config.json's `quantization_config`), kept in their stored bits in memory.

Each format is a LinearFormat (base.py): the parameters a quantized Linear holds in place of its weight, how a
checkpoint module's tensors become those parameters (repacked at most, never widened), the bytes they take, and
the LinearMethod that multiplies by them. config.py reads `quantization_config` as vLLM does and says which
checkpoint modules each format covers; everything it does not know is refused at load with what is supported.
"""
from pagedllm.model_executor.quant.config import SUPPORTED_FORMATS, CheckpointQuant, checkpoint_quant, planned_quant

__all__ = ["SUPPORTED_FORMATS", "CheckpointQuant", "checkpoint_quant", "planned_quant"]
