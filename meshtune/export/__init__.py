"""`meshtune export`: a run's result in the formats other tools load.

`peft.py` writes LoRA and DoRA adapters as a PEFT folder (transformers, vLLM, TGI);
`fused.py` writes the fused model as a Hugging Face folder, and as GGUF where mlx-lm
converts the family.
"""

from .fused import export_gguf, export_hf
from .peft import export_peft, peft_config, peft_tensors

__all__ = ["export_gguf", "export_hf", "export_peft", "peft_config", "peft_tensors"]
