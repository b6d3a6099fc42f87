"""VocAgnoLM (docs/methods/vocagnolm.md): continual training of a student with token selection
guided by a frozen teacher that may use another tokenizer (task ``vocagnolm``).

Run (documents as JSONL lines {"text": ...}; the teacher: any training workdir of this repo, e.g.
a configs/lm.py run with a SentencePiece tokenizer; the student starts from its own LM run):
  python -m icml_jax.main --config=configs/vocagnolm.py:default --workdir=runs/voc \\
      --config.data.path=math.jsonl --config.train.init_from=runs/student_lm \\
      --config.loss.voc_teacher=runs/teacher
The experiment: python -m experiments.vocagnolm --workdir=runs/vocagnolm [--preset=tiny|default]

``config.loss``:
  voc_mode              guided (VocAgnoLM) | rho1 (teacher with the student's tokenizer) | ce (all
                        tokens) | random (a random voc_k_ratio) | student_topk (top by student loss)
  voc_teacher           the teacher's training workdir (guided, rho1): model config from its
                        config.json, params from its newest checkpoint
  voc_teacher_tokenizer "" = the teacher run's data.tokenizer; a SentencePiece .model path; "byte"
  voc_teacher_seq_len   teacher tokens per row (0 = data.seq_len)
  voc_k_ratio           0.4: the share of the mapped tokens trained on
  voc_agg               max | mean | min: the teacher loss over a student token's aligned range
  voc_include_unmapped  True: student tokens with no teacher counterpart are always trained on
  voc_select_scope      batch | sequence: where the top share is taken
  voc_span_pad          8: teacher tokens per student token at most (longer ranges are cut)

Presets: ``tiny`` (tests), ``default`` (the experiment's student: 2 layers, d=128, byte tokens).
"""
import ml_collections

from icml_jax.config_utils import sibling_config

lm = sibling_config(__file__)

LOSS = dict(voc_mode="guided", voc_teacher="", voc_teacher_tokenizer="", voc_teacher_seq_len=0,
            voc_k_ratio=0.4, voc_agg="max", voc_include_unmapped=True, voc_select_scope="batch",
            voc_span_pad=8)

PRESETS = {
    "tiny": dict(
        model=dict(d_model=32, num_layers=1, num_heads=2, num_kv_heads=2, head_dim=16, ffn_dim=64,
                   max_seq_len=128),
        data=dict(seq_len=48),
        train=dict(steps=4, batch_size=4, lr=3e-3, warmup_steps=1, log_every=2, eval_every=4,
                   eval_batches=1, checkpoint_every=4, progress=False, async_checkpoint=False),
    ),
    "default": dict(
        model=dict(d_model=128, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=32, ffn_dim=384,
                   max_seq_len=256),
        data=dict(seq_len=192),
        train=dict(steps=300, batch_size=16, lr=2e-3, warmup_steps=30, log_every=50, eval_every=300,
                   eval_batches=2, checkpoint_every=300),
    ),
}


def get_config(preset: str = "default") -> ml_collections.ConfigDict:
    """``configs/lm.py``'s base with task="vocagnolm", JSONL documents and ``config.loss``."""
    return lm.preset_config(
        PRESETS, preset, default="default", where="configs/vocagnolm.py", sections={"loss": LOSS},
        base={"task": "vocagnolm", "data": {"name": "jsonl"}, "train": {"samples": 0}})
