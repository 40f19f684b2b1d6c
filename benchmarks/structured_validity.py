"""Share of valid JSON under a schema on the default model: any whitespace, one line, and
the default (one line with the budget-aware ending).

Each of the schemas below (nested objects, arrays with and without bounds, enums, optional
fields, string formats and patterns, bounded numbers, booleans, arrays of objects) comes
with a prompt that asks for it. Every schema runs offline through ``forerun.LLM()`` (the
default model and dtype) with ``max_tokens=256``, greedy and at temperature 0.7 (seeded),
once per variant: "any" is ``disable_any_whitespace=False`` (the grammar allows any
whitespace, as vLLM's default and forerun's old one), "one line" the compact grammar with
``disable_budget_closing=True`` (no budget-aware ending), "closing" forerun's default. An
output is valid when ``json.loads`` parses it and ``jsonschema`` (with its format checker)
validates it. Each output is also counted by how it ended: ``natural`` (the model ended the
JSON), ``closed`` (the budget-aware ending completed it; ``finish_reason == "length"`` with
complete JSON) or ``cut`` (``max_tokens`` cut it: invalid). The grammar makes every output
a prefix of JSON in the schema, so an invalid output is almost always a cut one; the rest
are strings xgrammar's formats accept and ``jsonschema``'s format checker does not.

    python benchmarks/structured_validity.py                 # every schema, a few minutes
    python benchmarks/structured_validity.py --limit 8       # the first 8, while developing
    python benchmarks/structured_validity.py --variants "one line" closing
"""

from __future__ import annotations

import argparse
import json
import logging
import platform
import statistics
import time
from collections import Counter
from typing import Any

import jsonschema
from common import markdown_table, write_json

from forerun import LLM, SamplingParams, StructuredOutputsParams

# (prompt, schema). Strings bounded and unbounded alike: real schemas are mostly unbounded.
CASES: list[tuple[str, dict[str, Any]]] = [
    ("Give a person's name and age.",
     {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
      "required": ["name", "age"]}),
    ("List the tags of a blog post about colours and say whether it is ok.",
     {"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string"}},
                                       "ok": {"type": "boolean"}},
      "required": ["tags", "ok"]}),
    ("Describe a book: its title, authors and year.",
     {"type": "object", "properties": {
         "title": {"type": "string"},
         "authors": {"type": "array", "items": {
             "type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}},
         "year": {"type": "integer"}},
      "required": ["title", "authors", "year"]}),
    ("Give the weather in a city today.",
     {"type": "object", "properties": {
         "city": {"type": "string"}, "temperature_c": {"type": "number"},
         "conditions": {"enum": ["sunny", "rainy", "cloudy", "snowy"]}},
      "required": ["city", "temperature_c", "conditions"]}),
    ("Classify the sentiment of the review 'Great food, slow service'.",
     {"type": "object", "properties": {
         "sentiment": {"enum": ["positive", "negative", "mixed"]},
         "confidence": {"type": "number", "minimum": 0, "maximum": 1}},
      "required": ["sentiment", "confidence"]}),
    ("Give a user's contact details.",
     {"type": "object", "properties": {
         "email": {"type": "string", "format": "email"},
         "phone": {"type": "string", "pattern": "^\\+?[0-9]{7,12}$"}},
      "required": ["email", "phone"]}),
    ("Schedule a meeting: its date and title.",
     {"type": "object", "properties": {
         "title": {"type": "string", "maxLength": 40}, "date": {"type": "string", "format": "date"}},
      "required": ["title", "date"]}),
    ("Log an event with a timestamp and a level.",
     {"type": "object", "properties": {
         "timestamp": {"type": "string", "format": "date-time"},
         "level": {"enum": ["debug", "info", "warning", "error"]},
         "message": {"type": "string"}},
      "required": ["timestamp", "level", "message"]}),
    ("Give a server's address and port.",
     {"type": "object", "properties": {
         "ip": {"type": "string", "format": "ipv4"},
         "port": {"type": "integer", "minimum": 1, "maximum": 65535}},
      "required": ["ip", "port"]}),
    ("Give an order id and its status.",
     {"type": "object", "properties": {
         "order_id": {"type": "string", "format": "uuid"},
         "status": {"enum": ["pending", "shipped", "delivered", "cancelled"]}},
      "required": ["order_id", "status"]}),
    ("Pick one to three favourite colours and a score from 0 to 10.",
     {"type": "object", "properties": {
         "colors": {"type": "array", "items": {"enum": ["red", "green", "blue", "yellow"]},
                    "minItems": 1, "maxItems": 3},
         "score": {"type": "integer", "minimum": 0, "maximum": 10}},
      "required": ["colors", "score"]}),
    ("Describe a product with a name, a price and whether it is in stock.",
     {"type": "object", "properties": {
         "name": {"type": "string"}, "price": {"type": "number", "minimum": 0},
         "in_stock": {"type": "boolean"}},
      "required": ["name", "price", "in_stock"]}),
    ("Describe a person with an address.",
     {"type": "object", "properties": {
         "name": {"type": "string"},
         "address": {"type": "object", "properties": {
             "street": {"type": "string"}, "city": {"type": "string"},
             "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
             "required": ["street", "city", "zip"]}},
      "required": ["name", "address"]}),
    ("Give the coordinates of Paris.",
     {"type": "object", "properties": {
         "lat": {"type": "number", "minimum": -90, "maximum": 90},
         "lon": {"type": "number", "minimum": -180, "maximum": 180}},
      "required": ["lat", "lon"]}),
    ("Write a todo list of two to four items.",
     {"type": "object", "properties": {"todos": {
         "type": "array", "minItems": 2, "maxItems": 4, "items": {
             "type": "object", "properties": {"task": {"type": "string"},
                                              "done": {"type": "boolean"}},
             "required": ["task", "done"]}}},
      "required": ["todos"]}),
    ("Answer yes or no: is the sky blue?",
     {"type": "object", "properties": {"answer": {"type": "boolean"}}, "required": ["answer"]}),
    ("Give a recipe: its name, ingredients and number of servings.",
     {"type": "object", "properties": {
         "name": {"type": "string"},
         "ingredients": {"type": "array", "items": {"type": "string"}, "maxItems": 8},
         "servings": {"type": "integer", "minimum": 1, "maximum": 12}},
      "required": ["name", "ingredients", "servings"]}),
    ("Describe a movie: title, year, genre and rating.",
     {"type": "object", "properties": {
         "title": {"type": "string"}, "year": {"type": "integer", "minimum": 1900,
                                               "maximum": 2030},
         "genre": {"enum": ["drama", "comedy", "action", "horror", "documentary"]},
         "rating": {"type": "number", "minimum": 0, "maximum": 10}},
      "required": ["title", "year", "genre", "rating"]}),
    ("Give a student's name and optionally their grade.",
     {"type": "object", "properties": {"name": {"type": "string"},
                                       "grade": {"type": "integer"}},
      "required": ["name"]}),
    ("Describe a company with its employees.",
     {"type": "object", "properties": {
         "company": {"type": "string"},
         "employees": {"type": "array", "maxItems": 3, "items": {
             "type": "object", "properties": {
                 "name": {"type": "string"},
                 "role": {"enum": ["engineer", "manager", "designer", "sales"]}},
             "required": ["name", "role"]}}},
      "required": ["company", "employees"]}),
    ("Give an RGB colour.",
     {"type": "object", "properties": {
         "r": {"type": "integer", "minimum": 0, "maximum": 255},
         "g": {"type": "integer", "minimum": 0, "maximum": 255},
         "b": {"type": "integer", "minimum": 0, "maximum": 255}},
      "required": ["r", "g", "b"]}),
    ("Give a hex colour code for sky blue.",
     {"type": "object", "properties": {"hex": {"type": "string",
                                               "pattern": "^#[0-9a-fA-F]{6}$"}},
      "required": ["hex"]}),
    ("Give a website's name and URL.",
     {"type": "object", "properties": {"name": {"type": "string"},
                                       "url": {"type": "string", "format": "uri"}},
      "required": ["name", "url"]}),
    ("Describe the settings of an app.",
     {"type": "object", "properties": {
         "theme": {"enum": ["light", "dark"]}, "notifications": {"type": "boolean"},
         "language": {"type": "string", "pattern": "^[a-z]{2}$"},
         "font_size": {"type": "integer", "minimum": 8, "maximum": 32}},
      "required": ["theme", "notifications", "language", "font_size"]}),
    ("Give a 3x3 grid of numbers.",
     {"type": "object", "properties": {"grid": {
         "type": "array", "minItems": 3, "maxItems": 3, "items": {
             "type": "array", "minItems": 3, "maxItems": 3, "items": {"type": "integer"}}}},
      "required": ["grid"]}),
    ("Give a list of prime numbers below 20.",
     {"type": "object", "properties": {"primes": {"type": "array", "items": {"type": "integer"}}},
      "required": ["primes"]}),
    ("Describe a flight.",
     {"type": "object", "properties": {
         "flight": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{2,4}$"},
         "from": {"type": "string", "pattern": "^[A-Z]{3}$"},
         "to": {"type": "string", "pattern": "^[A-Z]{3}$"},
         "departure": {"type": "string", "format": "date-time"}},
      "required": ["flight", "from", "to", "departure"]}),
    ("Give a bank transaction.",
     {"type": "object", "properties": {
         "amount": {"type": "number", "exclusiveMinimum": 0},
         "currency": {"enum": ["USD", "EUR", "GBP", "JPY"]},
         "description": {"type": "string", "maxLength": 60}},
      "required": ["amount", "currency", "description"]}),
    ("Describe a pet.",
     {"type": "object", "properties": {
         "name": {"type": "string"}, "species": {"enum": ["dog", "cat", "bird", "fish"]},
         "age": {"type": "integer", "minimum": 0, "maximum": 30},
         "vaccinated": {"type": "boolean"}},
      "required": ["name", "species"]}),
    ("Give a quiz question with four options and the index of the answer.",
     {"type": "object", "properties": {
         "question": {"type": "string"},
         "options": {"type": "array", "items": {"type": "string"}, "minItems": 4, "maxItems": 4},
         "answer": {"type": "integer", "minimum": 0, "maximum": 3}},
      "required": ["question", "options", "answer"]}),
    ("Describe a country: name, capital, population and languages.",
     {"type": "object", "properties": {
         "name": {"type": "string"}, "capital": {"type": "string"},
         "population": {"type": "integer", "minimum": 0},
         "languages": {"type": "array", "items": {"type": "string"}, "minItems": 1}},
      "required": ["name", "capital", "population", "languages"]}),
    ("Give an HTTP response summary.",
     {"type": "object", "properties": {
         "status": {"type": "integer", "minimum": 100, "maximum": 599},
         "headers": {"type": "object", "properties": {
             "content_type": {"type": "string"}, "length": {"type": "integer"}},
             "required": ["content_type"]}},
      "required": ["status", "headers"]}),
    ("Describe a car.",
     {"type": "object", "properties": {
         "make": {"type": "string"}, "model": {"type": "string"},
         "year": {"type": "integer", "minimum": 1950, "maximum": 2026},
         "electric": {"type": "boolean"}},
      "required": ["make", "model", "year", "electric"]}),
    ("Give a short poem with a title and its lines.",
     {"type": "object", "properties": {
         "title": {"type": "string"},
         "lines": {"type": "array", "items": {"type": "string"}, "minItems": 2, "maxItems": 4}},
      "required": ["title", "lines"]}),
    ("Rate a restaurant's food, service and price from 1 to 5.",
     {"type": "object", "properties": {
         "food": {"type": "integer", "minimum": 1, "maximum": 5},
         "service": {"type": "integer", "minimum": 1, "maximum": 5},
         "price": {"type": "integer", "minimum": 1, "maximum": 5}},
      "required": ["food", "service", "price"]}),
    ("Describe a tree of folders: a root folder with its children.",
     {"type": "object", "properties": {
         "name": {"type": "string"},
         "children": {"type": "array", "maxItems": 3, "items": {
             "type": "object", "properties": {
                 "name": {"type": "string"},
                 "files": {"type": "array", "items": {"type": "string"}, "maxItems": 3}},
             "required": ["name", "files"]}}},
      "required": ["name", "children"]}),
    ("Extract the entities in 'Alice met Bob in London on Monday'.",
     {"type": "object", "properties": {
         "people": {"type": "array", "items": {"type": "string"}},
         "places": {"type": "array", "items": {"type": "string"}},
         "day": {"enum": ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday",
                          "Saturday", "Sunday"]}},
      "required": ["people", "places", "day"]}),
    ("Give the result of a football match.",
     {"type": "object", "properties": {
         "home": {"type": "string"}, "away": {"type": "string"},
         "score": {"type": "array", "items": {"type": "integer", "minimum": 0},
                   "minItems": 2, "maxItems": 2}},
      "required": ["home", "away", "score"]}),
    ("Give a user profile; the nickname is optional.",
     {"type": "object", "properties": {
         "username": {"type": "string", "pattern": "^[a-z0-9_]{3,16}$"},
         "nickname": {"type": "string"}, "verified": {"type": "boolean"}},
      "required": ["username", "verified"]}),
    ("Convert 5 kilometres to miles.",
     {"type": "object", "properties": {
         "km": {"type": "number"}, "miles": {"type": "number"}},
      "required": ["km", "miles"]}),
    ("Give a traffic light state.",
     {"type": "object", "properties": {
         "light": {"enum": ["red", "amber", "green"]},
         "seconds_left": {"type": "integer", "minimum": 0, "maximum": 120}},
      "required": ["light", "seconds_left"]}),
    ("Describe a shopping cart with items and quantities.",
     {"type": "object", "properties": {
         "items": {"type": "array", "minItems": 1, "maxItems": 5, "items": {
             "type": "object", "properties": {
                 "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{3}$"},
                 "quantity": {"type": "integer", "minimum": 1, "maximum": 10}},
             "required": ["sku", "quantity"]}},
         "total": {"type": "number", "minimum": 0}},
      "required": ["items", "total"]}),
    ("Give a version number of a software release.",
     {"type": "object", "properties": {
         "version": {"type": "string", "pattern": "^[0-9]+\\.[0-9]+\\.[0-9]+$"},
         "stable": {"type": "boolean"}},
      "required": ["version", "stable"]}),
    ("Summarise a news article in JSON.",
     {"type": "object", "properties": {
         "headline": {"type": "string", "maxLength": 80},
         "summary": {"type": "string", "maxLength": 200},
         "topics": {"type": "array", "items": {"enum": ["politics", "sports", "science",
                                                        "business", "culture"]},
                    "maxItems": 3}},
      "required": ["headline", "summary", "topics"]}),
    ("Give a chess move.",
     {"type": "object", "properties": {
         "from": {"type": "string", "pattern": "^[a-h][1-8]$"},
         "to": {"type": "string", "pattern": "^[a-h][1-8]$"},
         "piece": {"enum": ["pawn", "knight", "bishop", "rook", "queen", "king"]}},
      "required": ["from", "to", "piece"]}),
    ("Describe a laptop's specifications.",
     {"type": "object", "properties": {
         "cpu": {"type": "string"}, "ram_gb": {"type": "integer", "minimum": 2, "maximum": 256},
         "storage": {"type": "object", "properties": {
             "type": {"enum": ["ssd", "hdd"]},
             "size_gb": {"type": "integer", "minimum": 32}},
             "required": ["type", "size_gb"]},
         "price": {"type": "number"}},
      "required": ["cpu", "ram_gb", "storage"]}),
    ("Give a to-do item with an optional due date.",
     {"type": "object", "properties": {
         "task": {"type": "string"}, "due": {"type": "string", "format": "date"},
         "priority": {"enum": ["low", "medium", "high"]}},
      "required": ["task", "priority"]}),
    ("Give a temperature reading series of three values.",
     {"type": "object", "properties": {
         "unit": {"enum": ["C", "F"]},
         "readings": {"type": "array", "items": {"type": "number", "minimum": -50,
                                                 "maximum": 60},
                      "minItems": 3, "maxItems": 3}},
      "required": ["unit", "readings"]}),
    ("Describe a family with parents and children.",
     {"type": "object", "properties": {
         "surname": {"type": "string"},
         "parents": {"type": "array", "minItems": 1, "maxItems": 2, "items": {
             "type": "object", "properties": {"name": {"type": "string"},
                                              "age": {"type": "integer", "minimum": 18}},
             "required": ["name", "age"]}},
         "children": {"type": "array", "items": {
             "type": "object", "properties": {"name": {"type": "string"},
                                              "age": {"type": "integer", "minimum": 0}},
             "required": ["name"]}}},
      "required": ["surname", "parents", "children"]}),
    ("Is 17 a prime number? Explain briefly.",
     {"type": "object", "properties": {
         "is_prime": {"type": "boolean"}, "reason": {"type": "string", "maxLength": 100}},
      "required": ["is_prime", "reason"]}),
    ("Give an API error.",
     {"type": "object", "properties": {"error": {"type": "object", "properties": {
         "code": {"type": "integer"}, "message": {"type": "string"},
         "retryable": {"type": "boolean"}},
         "required": ["code", "message"]}},
      "required": ["error"]}),
    ("Describe a planet.",
     {"type": "object", "properties": {
         "name": {"type": "string"}, "moons": {"type": "integer", "minimum": 0},
         "has_rings": {"type": "boolean"},
         "type": {"enum": ["rocky", "gas giant", "ice giant", "dwarf"]}},
      "required": ["name", "moons", "has_rings", "type"]}),
    ("Give the opening hours of a shop for two days.",
     {"type": "object", "properties": {"hours": {
         "type": "array", "minItems": 2, "maxItems": 2, "items": {
             "type": "object", "properties": {
                 "day": {"type": "string"},
                 "open": {"type": "string", "pattern": "^[0-2][0-9]:[0-5][0-9]$"},
                 "close": {"type": "string", "pattern": "^[0-2][0-9]:[0-5][0-9]$"}},
             "required": ["day", "open", "close"]}}},
      "required": ["hours"]}),
    ("Give a translation of 'hello' into French and Spanish.",
     {"type": "object", "properties": {"translations": {"type": "object", "properties": {
         "fr": {"type": "string"}, "es": {"type": "string"}}, "required": ["fr", "es"]}},
      "required": ["translations"]}),
    ("Give a list of keywords for an article about machine learning.",
     {"type": "object", "properties": {"keywords": {
         "type": "array", "items": {"type": "string", "maxLength": 20},
         "minItems": 1, "maxItems": 6}},
      "required": ["keywords"]}),
]
# Not a schema: OpenAI's JSON mode (any object), with a prompt of its own.
JSON_OBJECT_PROMPTS = ["Describe a cat as a JSON object.",
                       "Give some facts about the moon as a JSON object."]
# (disable_any_whitespace, disable_budget_closing) per variant: "any" is vLLM's default
# grammar (and forerun's first), "one line" the compact grammar alone, "closing" forerun's
# default (compact, and the budget-aware ending of forerun/structured/closing.py).
VARIANTS = {"any": (False, True), "one line": (None, True), "closing": (None, None)}
CHECKER = jsonschema.FormatChecker()


def build(cases: list[tuple[str, dict[str, Any] | None]], variants: list[str],
          temperatures: list[float], max_tokens: int) -> tuple[list[list[dict[str, str]]], list[SamplingParams],
                                    list[dict[str, Any]]]:
    """One request per (variant, temperature, case); ``keys`` says which is which."""
    convs, params, keys = [], [], []
    for variant in variants:
        daw, dbc = VARIANTS[variant]
        for temp in temperatures:
            for i, (prompt, schema) in enumerate(cases):
                opts = {"disable_any_whitespace": daw, "disable_budget_closing": dbc}
                so = (StructuredOutputsParams(json_object=True, **opts) if schema is None
                      else StructuredOutputsParams(json=schema, **opts))
                convs.append([{"role": "user", "content": prompt + " Answer in JSON."}])
                params.append(SamplingParams(max_tokens=max_tokens, temperature=temp,
                                             seed=i if temp > 0 else None,
                                             structured_outputs=so))
                keys.append({"variant": variant, "temperature": temp, "case": i})
    return convs, params, keys


def check(text: str, schema: dict[str, Any] | None) -> str:
    """``valid``, or why not: ``parse`` (not JSON) or ``schema`` (JSON, not the schema)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return "parse"
    try:
        jsonschema.validate(value, schema or {"type": "object"}, format_checker=CHECKER)
    except jsonschema.ValidationError:
        return "schema"
    return "valid"


def ending(finish_reason: str | None, text: str) -> str:
    """``natural`` (the model ended the JSON), ``closed`` (the budget-aware ending did: it
    reports ``length`` with complete JSON) or ``cut`` (``max_tokens`` cut the JSON).

    Parsing alone decides closed against cut, so a schema failure does not move an output
    between them. Without the budget-aware ending, ``closed`` counts outputs whose JSON the
    model happened to complete on the very last token.
    """
    if finish_reason != "length":
        return "natural"
    try:
        json.loads(text)
    except json.JSONDecodeError:
        return "cut"
    return "closed"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--limit", type=int, default=None, help="only the first N schemas")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 0.7])
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    ap.add_argument("--json", default=None, help="where to write the results "
                    "(default benchmarks/results/structured_validity.json)")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)

    cases: list[tuple[str, dict[str, Any] | None]] = list(CASES[:args.limit])
    cases += [(p, None) for p in JSON_OBJECT_PROMPTS[:1 if args.limit else None]]
    convs, params, keys = build(cases, args.variants, args.temperatures, args.max_tokens)
    llm = LLM()
    t0 = time.perf_counter()
    # One batch for every cell: the rows are independent (seeded or greedy).
    outs = llm.chat(convs, params, use_tqdm=False)
    wall = time.perf_counter() - t0

    samples = []
    for key, out in zip(keys, outs, strict=True):
        c = out.outputs[0]
        result = check(c.text, cases[key["case"]][1])
        samples.append({**key, "result": result, "ended": ending(c.finish_reason, c.text),
                        "finish_reason": c.finish_reason, "tokens": len(c.token_ids),
                        "text": c.text})
    rows = []
    for variant in args.variants:
        for temp in args.temperatures:
            cell = [s for s in samples if s["variant"] == variant and s["temperature"] == temp]
            results = Counter(s["result"] for s in cell)
            finishes = Counter(s["finish_reason"] for s in cell)
            ends = Counter(s["ended"] for s in cell)
            rows.append({
                "variant": variant, "temperature": temp, "n": len(cell),
                "valid": results["valid"], "valid_share": results["valid"] / len(cell),
                "mean_tokens": statistics.mean(s["tokens"] for s in cell),
                "natural": ends["natural"], "closed": ends["closed"], "cut": ends["cut"],
                "finish_reasons": ", ".join(f"{k} {v}" for k, v in sorted(finishes.items())),
                "invalid": ", ".join(f"{k} {v}" for k, v in sorted(results.items())
                                     if k != "valid") or "-",
            })
    print(f"\n{len(cases)} schemas ({len(CASES[:args.limit])} JSON schemas + json_object), "
          f"max_tokens={args.max_tokens}, {len(samples)} requests in {wall:.0f} s")
    print(markdown_table(rows, ["variant", "temperature", "n", "valid", "valid_share",
                                "mean_tokens", "natural", "closed", "cut", "finish_reasons",
                                "invalid"]))
    stats = llm.llm_engine.scheduler.structured_output_manager.stats
    print(f"budget-aware ending: {stats.num_closing} requests entered the closing phase, "
          f"{stats.num_closed} of them it completed")
    for s in samples:
        if s["result"] != "valid":
            print(f"  {s['variant']} T={s['temperature']} case {s['case']} "
                  f"({s['finish_reason']}, {s['tokens']} tokens): {s['text'][:100]!r}")
    path = write_json("structured_validity.json", {
        "benchmark": "structured_validity",
        "config": {**vars(args), "model": "default", "dtype": "default",
                   "num_cases": len(cases)},
        "machine": {"platform": platform.platform(), "processor": platform.processor()},
        "wall_s": wall,
        "rows": rows,
        "closing_phase": {"entered": stats.num_closing, "completed": stats.num_closed},
        "samples": samples,
    }, args.json)
    print(f"wrote {path}")
    llm.shutdown()


if __name__ == "__main__":
    main()
