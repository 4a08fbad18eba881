"""Hugging Face transformers: gradient checkpointing through fastckpt, with HF's own layer selection.

One concept per file; each imports only files listed after it:

- checkpointing.py: `enable`, `disable`, `is_enabled`: HF's checkpointing layers pointed at fastckpt.checkpoint,
  and the patches the files below hold (PATCHES), installed and removed through one interface (patches.py);
- planning.py: `plan`, `measure` (fastckpt's planner on a step built from a batch), `planned`, `PLAN_MAX_ERROR`
  and `enable(budget=...)`'s plan on the first training batch (`_FirstBatchPlan`);
- trainer.py: what the training loop built after `enable` (Trainer's optimizer, the Trainer), found at the first
  training batch, and `enable(optimizer_in_backward=True)`'s step in the backward (`_StepInBackward`);
- loss_head.py: `enable(loss_head=True)`, the training loss through fastckpt.linear_cross_entropy (`LossHead`),
  and `loss_head_enabled`;
- trl_head.py: the same switch under TRL's fused LM head (`model(..., fused_lm_head=True)`): TRL's per-token
  kernel served by fastckpt.linear_log_probs for the models whose loss head is on (`TrlHead`);
- families.py: what each model family's forward does to its logits before the loss (soft caps, scales);
- attention.py: `enable(padded_attention=True)`, SDPA on padded or packed rows without the [tokens x tokens]
  mask: the mask form (`CausalSegmentsMask`) and the calls per segment (`PaddedAttention`);
- tiled_mlp.py: `enable(tile_mlp=...)`, the decoder layers' MLPs computed in tiles of tokens, each recomputed
  alone in backward, and the norms folded into the tiles of the modules they feed (`TiledMLPs`, through
  fastckpt.tiling.recompute_in_tiles);
- adapters.py: PEFT LoRA's input casts that autocast undoes, switched off (`AdapterInputCasts`);
- pretrained.py: the transformers PreTrainedModel behind the model passed (a PEFT model unwrapped);
- gateway.py: the one door to transformers', PEFT's, TRL's and accelerate's internals and torch Module's hook
  dictionaries, each entry with the versions checked and what happens without it (`python -m fastckpt.info`);
- patches.py: `Patch` (wanted / check / install / remove), the interface of every patch above, and `Settings`,
  what enable() was called with;
- state.py: what the integration keeps about a model, one `ModelState` in one attribute.
"""

from fastckpt.integrations.hf.checkpointing import disable, enable, is_enabled
from fastckpt.integrations.hf.loss_head import loss_head_enabled
from fastckpt.integrations.hf.planning import PLAN_MAX_ERROR, measure, plan, planned

__all__ = ["PLAN_MAX_ERROR", "disable", "enable", "is_enabled", "loss_head_enabled", "measure", "plan", "planned"]
