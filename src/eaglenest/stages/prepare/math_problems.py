"""``builtin:math-problems``: grade-school word problems, written from templates with seeded numbers.

Math word problems (the traffic GSM8K stands for) are answered step by step: restated quantities, one
operation per line, the numbers of the question copied into the reply. The chat sources rarely carry them.
Each problem here is one of ``TEMPLATES`` filled with names, items and numbers drawn from a
``random.Random`` seeded by the problem's number, so the source is the same on every machine and needs no
snapshot. The problems are prompts only: the verifier writes the worked answers (``prepare.regenerate:
true``), so the draft learns the verifier's own way of solving them, not an answer key.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator

COUNT = 600  # problems the source holds; prepare takes its share of max_conversations from them
NAMES = (
    "Ava",
    "Ben",
    "Carla",
    "Dev",
    "Elena",
    "Farid",
    "Grace",
    "Hiro",
    "Isla",
    "Jonas",
    "Keiko",
    "Liam",
    "Maya",
    "Noah",
    "Olu",
    "Priya",
    "Quinn",
    "Rosa",
    "Sami",
    "Tara",
)
ITEMS = (
    ("apples", "a bag of"),
    ("pencils", "a box of"),
    ("cookies", "a tray of"),
    ("stickers", "a sheet of"),
    ("eggs", "a carton of"),
    ("marbles", "a jar of"),
    ("cupcakes", "a box of"),
    ("cards", "a pack of"),
)
ASKS = ("", " Show your work.", " Explain each step.", " Give the answer and how you got it.")


def _shopping(rng: random.Random) -> str:
    name = rng.choice(NAMES)
    item, pack = rng.choice(ITEMS)
    packs, per_pack, price = rng.randint(2, 9), rng.randint(4, 24), rng.randint(2, 15)
    return (
        f"{name} buys {packs} packs of {item}. Each pack holds {per_pack} {item} and costs ${price}. "
        f"How many {item} does {name} have, and how much did {name} spend?"
    )


def _remaining(rng: random.Random) -> str:
    name, friend = rng.sample(NAMES, 2)
    item, pack = rng.choice(ITEMS)
    start = rng.randint(30, 120)
    given, eaten = rng.randint(3, start // 3), rng.randint(2, start // 4)
    return (
        f"{name} had {start} {item}. {name} gave {given} to {friend} and then used {eaten} more. "
        f"How many {item} are left?"
    )


def _sharing(rng: random.Random) -> str:
    name = rng.choice(NAMES)
    item, pack = rng.choice(ITEMS)
    friends = rng.randint(2, 8)
    each, extra = rng.randint(3, 12), rng.randint(0, friends - 1)
    return (
        f"{name} has {friends * each + extra} {item} and shares them equally among {friends} friends. "
        f"How many does each friend get, and how many are left over?"
    )


def _speed(rng: random.Random) -> str:
    name = rng.choice(NAMES)
    speed, hours, minutes = rng.randint(20, 90), rng.randint(1, 5), rng.choice((0, 15, 30, 45))
    vehicle = rng.choice(("drives", "cycles", "takes a train"))
    return (
        f"{name} {vehicle} at {speed} kilometers per hour for {hours} hours and {minutes} minutes. "
        f"How far does {name} travel?"
    )


def _discount(rng: random.Random) -> str:
    thing = rng.choice(("jacket", "bicycle", "lamp", "backpack", "pair of shoes", "board game"))
    price, percent = rng.randint(4, 60) * 5, rng.choice((10, 15, 20, 25, 30, 40, 50))
    tax = rng.choice((0, 5, 8, 10))
    tail = f" A sales tax of {tax}% is added to the sale price." if tax else ""
    return f"A {thing} costs ${price}. It is on sale for {percent}% off.{tail} What is the final price?"


def _ages(rng: random.Random) -> str:
    name, sibling = rng.sample(NAMES, 2)
    age, times, years = rng.randint(4, 15), rng.randint(2, 4), rng.randint(2, 10)
    return (
        f"{sibling} is {age} years old. {name} is {times} times as old as {sibling}. "
        f"How old will {name} be in {years} years, and what will the difference in their ages be then?"
    )


def _savings(rng: random.Random) -> str:
    name = rng.choice(NAMES)
    goal, saved, weekly = rng.randint(10, 60) * 10, rng.randint(1, 9) * 10, rng.randint(5, 40)
    thing = rng.choice(("a guitar", "a tablet", "a telescope", "a trip", "a new bike"))
    return (
        f"{name} wants to buy {thing} that costs ${goal + saved}. {name} has saved ${saved} and saves "
        f"${weekly} every week. How many weeks until {name} can afford it?"
    )


def _area(rng: random.Random) -> str:
    length, width = rng.randint(5, 40), rng.randint(3, 30)
    per_square = rng.randint(2, 12)
    place = rng.choice(("garden", "room", "playground", "patio"))
    return (
        f"A rectangular {place} is {length} meters long and {width} meters wide. What are its area and "
        f"perimeter? Covering it costs ${per_square} per square meter: what does that cost?"
    )


def _average(rng: random.Random) -> str:
    name = rng.choice(NAMES)
    scores = [rng.randint(55, 100) for _ in range(rng.randint(3, 6))]
    return (
        f"{name} scored {', '.join(map(str, scores[:-1]))} and {scores[-1]} on {len(scores)} tests. "
        f"What is {name}'s average score? What score on the next test would raise the average by 2 points?"
    )


def _work_rate(rng: random.Random) -> str:
    first, second = rng.sample(NAMES, 2)
    hours_first, hours_second = rng.randint(2, 8), rng.randint(3, 12)
    job = rng.choice(("paint a fence", "fill a pool", "sort the mail", "mow the lawn"))
    return (
        f"{first} can {job} in {hours_first} hours. {second} can do it in {hours_second} hours. "
        f"How long does it take if they work together?"
    )


def _recipe(rng: random.Random) -> str:
    serves, wanted = rng.randint(2, 6), rng.randint(7, 20)
    flour, sugar = rng.randint(1, 4) * 100, rng.randint(1, 6) * 25
    dish = rng.choice(("pancakes", "muffins", "bread", "a cake"))
    return (
        f"A recipe for {dish} serves {serves} people and uses {flour} grams of flour and {sugar} grams of "
        f"sugar. How much of each is needed to serve {wanted} people?"
    )


def _time(rng: random.Random) -> str:
    name = rng.choice(NAMES)
    start_hour, start_minute = rng.randint(6, 11), rng.choice((0, 10, 20, 30, 40, 50))
    tasks = [
        (rng.choice(("homework", "piano practice", "chores", "reading", "a run")), rng.randint(15, 90))
        for _ in range(3)
    ]
    listed = ", ".join(f"{task} for {minutes} minutes" for task, minutes in tasks)
    return f"{name} starts at {start_hour}:{start_minute:02d} a.m. and does {listed}. What time does {name} finish?"


TEMPLATES: tuple[Callable[[random.Random], str], ...] = (
    _shopping,
    _remaining,
    _sharing,
    _speed,
    _discount,
    _ages,
    _savings,
    _area,
    _average,
    _work_rate,
    _recipe,
    _time,
)


def math_problems(count: int = COUNT) -> Iterator[str]:
    """``count`` problems, the templates in turn, problem ``i``'s numbers drawn from ``Random(i)``."""
    for number in range(count):
        rng = random.Random(number)
        yield TEMPLATES[number % len(TEMPLATES)](rng) + rng.choice(ASKS)
