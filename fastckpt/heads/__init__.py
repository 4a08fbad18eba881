"""The loss heads: the language-model head and its loss computed a chunk of tokens at a time, without the full
[tokens x vocab] logits.

- chunks.py: what they share: the chunk size, the head's dtype, the softmax over vocabulary slices in fp32;
- cross_entropy.py: `linear_cross_entropy` (the causal-LM loss; its gradients computed in the forward);
- log_probs.py: `linear_log_probs` (each token's log-probability and entropy, for preference and RL losses);
- tied.py: `TiedGradient`, for a head whose weight is the input embedding's.

How a model's forward is routed through them (transformers, TRL) is fastckpt/integrations/hf's.
"""

from fastckpt.heads.chunks import default_chunk_size
from fastckpt.heads.cross_entropy import backward_repeated, linear_cross_entropy
from fastckpt.heads.log_probs import linear_log_probs
from fastckpt.heads.tied import TiedGradient

__all__ = ["TiedGradient", "backward_repeated", "default_chunk_size", "linear_cross_entropy", "linear_log_probs"]
