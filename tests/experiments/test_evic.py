"""experiments/evic at its tiny preset: every arm trains and is scored; the selecting arms'
rounds are summarised; the curriculum sampler moves through the domains."""
import csv
import json
import os

from experiments.evic.__main__ import ARMS, DOMAINS, PRESETS, _register_curriculum, main, steps_to_reach
from icml_jax.data import multidomain


def test_evic_tiny_outputs(tmp_path):
    wd = str(tmp_path / "exp")
    main([f"--workdir={wd}", "--preset=tiny"])
    exp = PRESETS["tiny"]
    for name in ("results.csv", "results.md", "em.png", "config.json"):
        assert os.path.getsize(os.path.join(wd, name)) > 0, name
    rows = list(csv.DictReader(open(os.path.join(wd, "results.csv"))))
    assert len(rows) == len(ARMS) * len(exp.seeds) * len(exp.evals)
    assert all(0 <= float(r["em_avg"]) <= 1 for r in rows)
    cfg = json.load(open(os.path.join(wd, "config.json")))
    # evic refreshes at start, start + every, ... < steps; static once
    n_rounds = len(range(exp.start, exp.run.train.steps, exp.every))
    assert len(cfg["selection"]["evic"]["kept"][0]) == n_rounds
    assert len(cfg["selection"]["static"]["kept"][0]) == 1
    assert len(cfg["selection"]["evic"]["sketch_flip_rate"][0]) == n_rounds  # the noise control ran
    assert "Gates:" in open(os.path.join(wd, "results.md")).read()


def test_curriculum_sampler_stages(tmp_path):
    from icml_jax.config_utils import load_config
    from icml_jax.tasks import TASKS
    _register_curriculum()
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in multidomain.make_rows(4, 0, domains=DOMAINS)))
    c = load_config("configs/sft.py:tiny", unlocked=True)
    c.task, c.data.path, c.train.steps, c.train.batch_size = "sft_curriculum", str(path), 6, 4
    task = TASKS.get("sft_curriculum")(c)
    tok = task.tokenizer

    def domains(batch):
        return {DOMAINS.index(tok.decode([int(t) for t in row[1:]]).split(" ")[0]) for row in batch["inputs"]}

    it = task.train_iterator(seed=0, shard=(0, 1))
    seen = [domains(next(it)) for _ in range(6)]
    assert seen[0] == seen[1] == {0}  # thirds of 6 steps: add, then add + rev, then all
    assert seen[2] | seen[3] <= {0, 1} and seen[4] | seen[5] <= {0, 1, 2}
    again = task.train_iterator(seed=0, shard=(0, 1))
    again.set_state(json.loads(json.dumps(it.get_state())))
    assert again.batches == 6 and again.round == 3
    assert domains(next(again)) == domains(next(it))


def test_steps_to_reach():
    rows = [{"step": 2, "em_avg": 0.1}, {"step": 4, "em_avg": 0.5}, {"step": 6, "em_avg": 0.4}]
    assert steps_to_reach(rows, 0.45) == 4 and steps_to_reach(rows, 0.9) is None
