"""Prompts for the speculative-decoding benchmark: input-grounded tasks, where the answer repeats the input,
and open-ended chat, where it does not."""

from __future__ import annotations

CODE = '''import json
import os


class Inventory:
    def __init__(self, path):
        self.path = path
        self.items = {}

    def load(self):
        if os.path.exists(self.path):
            with open(self.path) as f:
                self.items = json.load(f)

    def save(self):
        with open(self.path, "w") as f:
            json.dump(self.items, f, indent=2)

    def add(self, name, count):
        self.items[name] = self.items.get(name, 0) + count

    def remove(self, name, count):
        if self.items.get(name, 0) < count:
            raise ValueError("not enough " + name)
        self.items[name] -= count

    def total(self):
        return sum(self.items.values())
'''

DOCUMENT = (
    "The Harbour Street Bridge was opened in 1911 and carried trams until 1958. In 1987 engineers found "
    "corrosion in the northern cables, and the bridge was closed to lorries while the cables were replaced. "
    "The replacement took three years and cost 14 million pounds. Since 1990 the bridge has carried only cars, "
    "bicycles and pedestrians. A survey in 2019 counted an average of 11,400 crossings a day, of which 2,300 were "
    "bicycles. The city council has proposed closing the bridge to cars on Sundays from next spring, a plan "
    "supported by the cycling association but opposed by shop owners on Harbour Street, who fear fewer visitors."
)

GROUNDED = [
    ("code-edit", f"Add a docstring to every method of this class. Reply with the complete file only.\n\n{CODE}"),
    ("code-annotate", f"Rewrite this file with type hints on every function. Reply with the code only.\n\n{CODE}"),
    ("doc-quotes", "Answer using direct quotes from the document, copied word for word.\n\nDocument:\n"
                   f"{DOCUMENT}\n\nQuestion: What happened to the bridge in 1987, and what is proposed now?"),
    ("summary-quotes", "Summarise this document in three bullet points. Each bullet must quote one full "
                       f"sentence of the document exactly.\n\n{DOCUMENT}"),
]

OPEN_CHAT = [
    ("story", "Write a short story about a lighthouse keeper who finds a message in a bottle."),
    ("advice", "What are some good habits for learning a new programming language?"),
    ("explain", "Explain why the sky is blue to a ten-year-old."),
    ("poem", "Write a poem about autumn in a big city."),
]
