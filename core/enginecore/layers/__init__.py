"""The layers a model is built from: import these, never a built-in module.

A model plugin builds its architecture from these layers. Attention goes through the
selected attention backend and every projection through the selected linear method, so
the same model runs on every device and with every weight format the installed plugins
provide (see ``docs/plugins.md``, "Writing a model").
"""

from enginecore.layers.activation import SiluAndMul
from enginecore.layers.attention import (
    Attention,
    AttentionBatch,
    AttentionContext,
    layer_sliding_windows,
)
from enginecore.layers.embedding import (
    ParallelLMHead,
    VocabParallelEmbedding,
    vocab_parallel_logits,
)
from enginecore.layers.fused_ops import FusedOps, install_fused_ops
from enginecore.layers.linear import (
    ColumnParallelLinear,
    LinearBase,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
    UnquantizedLinearMethod,
    use_linear_method,
)
from enginecore.layers.norm import LayerNorm, RMSNorm
from enginecore.layers.parallel import divide, tp_all_gather_last_dim, tp_all_reduce
from enginecore.layers.pipeline import PPMissingLayer, pp_layer_range
from enginecore.layers.rotary import RotaryEmbedding, rope_parameters
from enginecore.layers.weights import MissingWeightsError, default_weight_loader, load_params

__all__ = [
    "Attention",
    "AttentionBatch",
    "AttentionContext",
    "ColumnParallelLinear",
    "FusedOps",
    "LayerNorm",
    "LinearBase",
    "MergedColumnParallelLinear",
    "MissingWeightsError",
    "PPMissingLayer",
    "ParallelLMHead",
    "QKVParallelLinear",
    "RMSNorm",
    "RotaryEmbedding",
    "RowParallelLinear",
    "SiluAndMul",
    "UnquantizedLinearMethod",
    "VocabParallelEmbedding",
    "default_weight_loader",
    "divide",
    "install_fused_ops",
    "layer_sliding_windows",
    "load_params",
    "pp_layer_range",
    "rope_parameters",
    "tp_all_gather_last_dim",
    "tp_all_reduce",
    "use_linear_method",
    "vocab_parallel_logits",
]
