"""Synthetic MedXpertQA files in the official JSONL layout (the real data cannot be downloaded
here): ``write_synthetic(path, n, subset, seed)``; labels, question types, medical tasks and body
systems drawn uniformly, MM rows with image references."""
import json

import numpy as np

TASKS = ("Diagnosis", "Treatment", "Basic Science")
SYSTEMS = ("Skeletal", "Cardiovascular", "Nervous", "Other / NA")


def synthetic_rows(n: int, subset: str = "text", seed: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)
    k = 10 if subset == "text" else 5
    rows = []
    for i in range(n):
        options = [{"letter": chr(65 + j), "content": f"o{i % 7}{j}"} for j in range(k)]
        choices = " ".join(f"({o['letter']}) {o['content']}" for o in options)
        row = {"id": f"{'Text' if subset == 'text' else 'MM'}-{i}",
               "question": f"Case {i}: which fits?\nAnswer Choices: {choices}",
               "options": options, "label": [chr(65 + int(rng.integers(k)))],
               "medical_task": TASKS[int(rng.integers(len(TASKS)))],
               "body_system": SYSTEMS[int(rng.integers(len(SYSTEMS)))],
               "question_type": ("Reasoning", "Understanding")[int(rng.integers(2))]}
        if subset == "mm":
            row["images"] = [{"image_path": f"MM-{i}-a.jpeg"}]
        rows.append(row)
    return rows


def write_rows(path, rows) -> str:
    with open(path, "w", encoding="utf-8") as f:
        for r in rows:
            f.write((r if isinstance(r, str) else json.dumps(r)) + "\n")
    return str(path)


def write_synthetic(path, n: int, subset: str = "text", seed: int = 0) -> str:
    return write_rows(path, synthetic_rows(n, subset, seed))
