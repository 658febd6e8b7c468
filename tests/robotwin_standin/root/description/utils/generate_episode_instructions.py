"""Stand-in for RoboTwin's instruction generator: fills {X} placeholders from episode parameters."""

import json
import os
from typing import Dict, List

HERE = os.path.dirname(os.path.abspath(__file__))


def generate_episode_descriptions(task_name: str, episodes: List[Dict[str, str]], max_descriptions: int = 1000000):
    with open(os.path.join(HERE, "..", "task_instruction", f"{task_name}.json")) as f:
        data = json.load(f)
    out = []
    for params in episodes:
        one = {}
        for kind in ("seen", "unseen"):
            filled = []
            for text in data[kind]:
                for key, value in params.items():
                    word = value.split("/")[0].split("_", 1)[-1]
                    text = text.replace(key, f"the {value} arm" if key.islower() else f"the {word}")
                if "{" not in text:
                    filled.append(text)
            one[kind] = filled[:max_descriptions]
        out.append(one)
    return out
