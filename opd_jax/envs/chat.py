"""Natural-language chat families for real pretrained chat models (SmolLM2, Qwen).

The built-in families speak the synthetic base's format ("<|max|><|user|>7+3=?<|assistant|>",
answers in think spans). These speak a chat model's own: a ChatML conversation with a
system message and a natural-language request, answered in prose that ends with
"Answer: ..." (or a JSON object for tool calls).

Families:
  word_arith  (general)  a short story of +/- (and from difficulty 3 "packs of") steps on
              an amount; difficulty 1..5 = 2, 3, 3, 4, 6 steps on growing numbers
              (`ARITH_LEVELS`). Answer: the final amount.
  json_call   (agent)    a request to call one of a fixed set of tools; the reply is the
              call as JSON {"name": ..., "arguments": {...}}; difficulty 1..5 = 1..5
              arguments (the tool's first k parameters; later ones defaulted).

Prompts are ChatML (`envs.chatml`), the format of SmolLM2 and Qwen2/2.5/3; a run checks that its
tokenizer's own chat template renders the same text (`episodes.check_chat_format`) before
any rollout, so a model with another template is refused, not fed a foreign format. Tasks
of these families take the effort "chat" (no control token, no think span, no length
penalty): the reward is correctness alone. Problems split train/eval by a hash of the
prompt, like every procedural family (`envs.data.split_of`).
"""
from __future__ import annotations

import json
import re

from opd_jax.envs.base import (CHAT_EFFORT, RewardResult, Task, TaskFamily, get_family,
                               register_family, render_prompt)

SYSTEM = {
    "word_arith": ("You are a careful math tutor. Solve the problem step by step, one "
                   "operation per line, then give the final number on its own line as "
                   "'Answer: <number>'."),
    "json_call": ("You are a function-calling assistant. Reply with exactly one JSON object "
                  "of the form {\"name\": <tool name>, \"arguments\": {<parameter>: "
                  "<value>, ...}} and nothing else."),
}


def chat_messages(task: Task) -> list[dict]:
    """The conversation a chat task's prompt renders: the family's system message and the
    request."""
    return [{"role": "system", "content": SYSTEM[task.family]},
            {"role": "user", "content": task.prompt}]


# -- word_arith ----------------------------------------------------------------------------
NAMES = ("Ava", "Ben", "Chloe", "Dev", "Emma", "Finn", "Grace", "Hugo", "Iris", "Jonah",
         "Kira", "Leo", "Maya", "Noah", "Olga", "Priya", "Quinn", "Rosa", "Sam", "Tara")
ITEMS = ("apples", "stickers", "marbles", "coins", "pencils", "cards", "stamps", "shells",
         "books", "cookies", "buttons", "beads")
ADD = (("buys {v} more", "buying"), ("finds {v} more", "finding"),
       ("gets {v} from a friend", "getting"), ("wins {v} more", "winning"))
SUB = (("gives {v} away", "giving away"), ("sells {v}", "selling"),
       ("loses {v}", "losing"), ("uses {v}", "using"))
# difficulty -> (steps, largest start, largest added/removed amount, "packs of" steps)
ARITH_LEVELS = {1: (2, 30, 9, False), 2: (3, 40, 20, False), 3: (3, 60, 40, True),
                4: (4, 60, 40, True), 5: (6, 60, 40, True)}
_NUM_RE = re.compile(r"-?\d[\d,]*")
_ANSWER_RE = re.compile(r"answer\s*[:=]?\s*\**\s*(-?\d[\d,]*)", re.IGNORECASE)


def gen_word_arith(rng, difficulty: int) -> tuple[str, dict]:
    """A story of `ARITH_LEVELS[difficulty]` steps; the amount never goes below one."""
    if difficulty not in ARITH_LEVELS:
        raise ValueError(f"word_arith: difficulty={difficulty!r}, expected one of "
                         f"{sorted(ARITH_LEVELS)}")
    steps, top, most, packs = ARITH_LEVELS[difficulty]
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    total = rng.randint(10, top)
    story, lines = [f"{name} has {total} {item}."], []
    start = total
    for i in range(steps):
        kinds = ("add", "sub", "pack") if i and packs else ("add", "sub")
        kind = rng.choice(kinds)
        if kind == "pack":
            k, m = rng.randint(2, 5), rng.randint(3, 12)
            story.append(f"Then {name} buys {k} packs of {m} {item}.")
            lines.append(f"{k} packs of {m}: {k} * {m} = {k * m}. {total} + {k * m} = "
                         f"{total + k * m}.")
            total += k * m
        elif kind == "sub" and total > 3:
            v = rng.randint(2, min(total - 1, most))
            verb, gerund = rng.choice(SUB)
            story.append(f"Then {name} {verb.format(v=v)}.")
            lines.append(f"After {gerund} {v}: {total} - {v} = {total - v}.")
            total -= v
        else:
            v = rng.randint(2, most)
            verb, gerund = rng.choice(ADD)
            story.append(f"Then {name} {verb.format(v=v)}.")
            lines.append(f"After {gerund} {v}: {total} + {v} = {total + v}.")
            total += v
    story[1] = story[1].replace("Then ", "", 1)
    story[1] = story[1][0].upper() + story[1][1:]
    prompt = " ".join(story) + f" How many {item} does {name} have now?"
    demo = "\n".join([f"{name} starts with {start} {item}.", *lines, f"Answer: {total}"])
    return prompt, {"answer": str(total), "demo": demo}


def final_number(text: str) -> str | None:
    """The reply's final answer: the number after its last "Answer:", else its last number
    (commas dropped)."""
    hits = _ANSWER_RE.findall(text)
    if hits:
        return hits[-1].replace(",", "")
    nums = _NUM_RE.findall(text)
    return nums[-1].replace(",", "") if nums else None


def word_arith_reward(task: Task, response: str) -> RewardResult:
    pred = final_number(response)
    correct = pred is not None and pred.lstrip("-").isdigit() and int(pred) == int(
        task.reference["answer"])
    return RewardResult(float(correct), {"correct": float(correct), "pred": (pred or "")[:32]})


# -- json_call -----------------------------------------------------------------------------
# Pools large enough that difficulty 2's eval split holds ~364 distinct calls (an evaluation
# draws distinct problems: `trainers.evaluate.heldout_tasks`); difficulty 1 holds ~13.
CITIES = ("Oslo", "Rome", "Lima", "Cairo", "Tokyo", "Dublin", "Madrid", "Seoul", "Quito",
          "Nairobi", "Lisbon", "Prague", "Hanoi", "Austin", "Denver", "Zurich", "Vienna",
          "Berlin", "Paris", "Athens", "Warsaw", "Helsinki", "Bergen", "Porto", "Milan",
          "Naples", "Geneva", "Munich", "Boston", "Chicago", "Dallas", "Miami", "Toronto",
          "Montreal", "Sydney", "Perth", "Auckland", "Manila", "Jakarta", "Bangkok", "Delhi",
          "Mumbai", "Dubai", "Doha", "Tunis", "Accra", "Dakar", "Bogota")
TOOLS = {
    "book_flight": (("origin", "city"), ("destination", "city"), ("passengers", "count"),
                    ("date", "date"), ("cabin", ("economy", "business", "first"))),
    "get_weather": (("city", "city"), ("days", "count"), ("unit", ("celsius", "fahrenheit")),
                    ("date", "date"), ("detail", ("low", "medium", "high"))),
    "reserve_table": (("restaurant", "name"), ("guests", "count"), ("date", "date"),
                      ("time", "time"), ("seating", ("indoor", "outdoor", "bar"))),
    "send_email": (("to", "email"), ("subject", "name"), ("priority", ("low", "normal", "high")),
                   ("date", "date"), ("copies", "count")),
}
RESTAURANTS = ("Blue Fig", "Casa Luna", "Red Lantern", "The Oak", "Saffron", "Nori House",
               "Olive Tree", "Green Door", "Salt Cellar", "Copper Pot", "Little Lamb",
               "Golden Duck", "Sea Breeze", "Old Mill", "Fig and Vine", "Silver Fork",
               "Pepper Mill", "Moon Garden")
PHRASES = {"origin": "from {v}", "destination": "to {v}", "passengers": "for {v} passengers",
           "date": "on {v}", "cabin": "in {v} class", "city": "in {v}", "days": "for the next {v} days",
           "unit": "in {v}", "detail": "with {v} detail", "restaurant": "at {v}",
           "guests": "for {v} guests", "time": "at {v}", "seating": "with {v} seating",
           "to": "to {v}", "subject": "with the subject \"{v}\"", "priority": "with {v} priority",
           "copies": "with {v} copies"}
VERBS = {"book_flight": "Book a flight", "get_weather": "Get the weather forecast",
         "reserve_table": "Reserve a table", "send_email": "Send an email"}


def _value(rng, kind, used_cities):
    if kind == "city":
        v = rng.choice([c for c in CITIES if c not in used_cities])
        used_cities.add(v)
        return v
    if kind == "count":
        return rng.randint(1, 20)
    if kind == "date":
        return f"2025-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}"
    if kind == "time":
        return f"{rng.randint(11, 22)}:{rng.choice(('00', '15', '30', '45'))}"
    if kind == "email":
        return f"{rng.choice(NAMES).lower()}@example.com"
    if kind == "name":
        return rng.choice(RESTAURANTS)
    return rng.choice(kind)


def gen_json_call(rng, difficulty: int) -> tuple[str, dict]:
    """A request naming `difficulty` of one tool's parameters, in shuffled order."""
    if not 1 <= difficulty <= 5:
        raise ValueError(f"json_call: difficulty={difficulty!r}, expected 1..5")
    tool = rng.choice(sorted(TOOLS))
    params = TOOLS[tool][:difficulty]
    used: set = set()
    args = {p: _value(rng, kind, used) for p, kind in params}
    order = list(args)
    rng.shuffle(order)
    spec = ", ".join(f"{p}: {'int' if kind == 'count' else 'str'}" for p, kind in TOOLS[tool])
    request = f"{VERBS[tool]} " + " ".join(PHRASES[p].format(v=args[p]) for p in order) + "."
    prompt = f"Tool: {tool}({spec})\nRequest: {request}"
    call = {"name": tool, "arguments": {p: args[p] for p, _ in params}}
    return prompt, {"answer": json.dumps(call), "demo": json.dumps(call)}


def parse_call(text: str):
    """The first JSON object in the reply (code fences allowed), or None."""
    start = text.find("{")
    while start >= 0:
        try:
            obj, _ = json.JSONDecoder().raw_decode(text[start:])
            return obj if isinstance(obj, dict) else None
        except json.JSONDecodeError:
            start = text.find("{", start + 1)
    return None


def json_call_reward(task: Task, response: str) -> RewardResult:
    """1 when the reply's call names the tool and exactly the requested arguments, with
    equal values (an int given as its digits in a string counts)."""
    want = json.loads(task.reference["answer"])
    got = parse_call(response)
    ok = (isinstance(got, dict) and got.get("name") == want["name"]
          and isinstance(got.get("arguments"), dict)
          and set(got["arguments"]) == set(want["arguments"])
          and all(str(got["arguments"][k]).strip() == str(v)
                  for k, v in want["arguments"].items()))
    return RewardResult(float(ok), {"correct": float(ok), "parsed": got is not None})


def reference_demo(task: Task) -> str:
    return task.reference["demo"]


WORD_ARITH = register_family(TaskFamily("word_arith", "general", gen_word_arith,
                                        word_arith_reward, demo=reference_demo, chat=chat_messages))
JSON_CALL = register_family(TaskFamily("json_call", "agent", gen_json_call, json_call_reward,
                                       demo=reference_demo, chat=chat_messages,
                                       # one problem = one call, whatever the order the
                                       # request names its arguments in
                                       canonical=lambda prompt, ref: ref["answer"]))


def check_chat_template(tokenizer, families) -> None:
    """Raise unless `tokenizer`'s own chat template renders the chat families among
    `families` (names) exactly as their prompts do (ChatML): a model is never fed a
    conversation format other than its own. Non-chat families are not checked."""
    for name in dict.fromkeys(families):
        fam = get_family(name)
        if fam.chat is None:
            continue
        task = Task(id="check", family=name, domain=fam.domain, effort=CHAT_EFFORT.name,
                    prompt="What is 2 + 3?", reference={"answer": "5", "demo": "5"})
        want = render_prompt(task)
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError(f"family {name!r} renders ChatML chat prompts, but the tokenizer "
                             f"has no chat template; expected a chat model's tokenizer "
                             f"(e.g. builtin:smollm2)")
        got = tokenizer.apply_chat_template(fam.chat(task), tokenize=False,
                                            add_generation_prompt=True)
        if got != want:
            raise ValueError(f"family {name!r} renders ChatML prompts ({want[:60]!r}...), "
                             f"but this tokenizer's chat template renders {got[:60]!r}...; "
                             f"expected a ChatML chat model (SmolLM2, Qwen2/2.5/3)")
