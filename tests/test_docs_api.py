"""The API the README and docs/INTEGRATION.md show is the API the code has.

Convention in those two files:

* A code span that is a call of a public name, ``cula_aot.NAME(...)``,
  ``cula_aot.MODULE.NAME(...)`` or ``torch.ops.cula_aot.NAME(...)``, with no ``...`` / ``…`` in its
  parentheses is a full parameter list: every parameter in order, ``*`` where keyword-only
  parameters start, ``name=default`` with the default as a Python literal, ``**name`` for a
  catch-all.  It must equal ``inspect.signature`` of the function, or the ``torch.library``
  schema of the op (names, order, which have defaults and their values; types are left out).
* A code span with ``...`` or ``…`` in it is an excerpt: each name it shows must be a parameter,
  in the signature's order.
* In ``python`` code blocks, every keyword argument passed to one of those names must be one of
  its parameters.

The README's API list names every public entry point with its full parameter list.  Skipped where
the docs are not beside the tests (the suite run against an installed wheel)."""

import ast
import importlib
import inspect
import re
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", ROOT / "docs" / "INTEGRATION.md"]
if not all(path.is_file() for path in DOCS):
    pytest.skip("README.md / docs/INTEGRATION.md are not beside the tests", allow_module_level=True)

import cula_aot  # noqa: E402  (registers the torch.ops schemas)

NAME = r"(?:torch\.ops\.cula_aot|cula_aot)(?:\.\w+)+"
SPAN = re.compile(rf"`({NAME})\((.*?)\)`")
CALL = re.compile(rf"(?<![\w.])({NAME}|kda_prefill_cp)\(")
ELLIPSIS = ("...", "…")

# The README's API list: each of these with its full parameter list.
PUBLIC = (
    "cula_aot.kda_prefill",
    "cula_aot.fwd",
    "cula_aot.kda_decode",
    "cula_aot.kda_decode_layer",
    "cula_aot.draft_buffers",
    "cula_aot.DecodeLayerStep",
    "cula_aot.preload",
    "torch.ops.cula_aot.kda_prefill",
    "torch.ops.cula_aot.kda_prefill_pool",
    "torch.ops.cula_aot.kda_decode",
    "torch.ops.cula_aot.kda_decode_layer",
    "cula_aot.fla.chunk_kda",
    "cula_aot.fla.fused_recurrent_kda",
    "cula_aot.fla.unsupported",
    "cula_aot.fla.fuse_decode_layers",
    "cula_aot.fla.register_backend",
    "cula_aot.distributed.kda_prefill_cp",
)


class Param:
    """One parameter as the docs write it: ``*``, ``name``, ``name=default``, ``*name``, ``**name``."""

    def __init__(self, name, kind="", default=inspect.Parameter.empty):
        self.name, self.kind, self.default = name, kind, default

    def __eq__(self, other):
        same_default = (self.default is inspect.Parameter.empty) == (other.default is inspect.Parameter.empty) and (
            self.default is inspect.Parameter.empty
            or (type(self.default) is type(other.default) and self.default == other.default)
        )
        return self.name == other.name and self.kind == other.kind and same_default

    def __repr__(self):
        default = "" if self.default is inspect.Parameter.empty else f"={self.default!r}"
        return f"{self.kind}{self.name}{default}"


def split_top_level(text):
    """Split at the commas outside brackets and string literals."""
    parts, depth, quote, start = [], 0, None, 0
    for i, ch in enumerate(text):
        if quote:
            quote = None if ch == quote else quote
        elif ch in "\"'":
            quote = ch
        elif ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        elif ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return [p.strip() for p in parts if p.strip()]


def parse_doc_params(text):
    params = []
    for item in split_top_level(text):
        if item == "*":
            params.append(Param("", "*"))
        elif item.startswith("**"):
            params.append(Param(item[2:], "**"))
        elif item.startswith("*"):
            params.append(Param(item[1:], "*"))
        elif "=" in item:
            name, default = item.split("=", 1)
            params.append(Param(name.strip(), "", ast.literal_eval(default.strip())))
        else:
            params.append(Param(item))
    return params


def resolve(name):
    """The documented name's parameters, as the docs would write them."""
    if name.startswith("torch.ops.cula_aot."):
        schema = getattr(torch.ops.cula_aot, name.rsplit(".", 1)[1]).default._schema
        params, keyword_only = [], False
        for arg in schema.arguments:
            if arg.kwarg_only and not keyword_only:
                params.append(Param("", "*"))
                keyword_only = True
            default = arg.default_value if arg.has_default_value() else inspect.Parameter.empty
            params.append(Param(arg.name, "", default))
        return params
    module_name, attr = ("cula_aot.distributed", name) if "." not in name else name.rsplit(".", 1)
    obj = getattr(importlib.import_module(module_name), attr)
    params, star_seen = [], False
    for p in inspect.signature(obj).parameters.values():
        if p.kind is p.KEYWORD_ONLY and not star_seen:
            params.append(Param("", "*"))
            star_seen = True
        if p.kind is p.VAR_POSITIONAL:
            params.append(Param(p.name, "*"))
            star_seen = True
        elif p.kind is p.VAR_KEYWORD:
            params.append(Param(p.name, "**"))
        else:
            params.append(Param(p.name, "", p.default))
    return params


def doc_spans():
    for path in DOCS:
        for lineno, line in enumerate(path.read_text().splitlines(), 1):
            for match in SPAN.finditer(line):
                yield f"{path.name}:{lineno}", match.group(1), match.group(2)


def code_calls():
    """(where, name, argument text) of each call of a documented name in the python blocks."""
    for path in DOCS:
        text = path.read_text()
        for block in re.finditer(r"```python\n(.*?)```", text, re.S):
            body = block.group(1)
            for match in CALL.finditer(body):
                depth, i = 1, match.end()
                while depth and i < len(body):
                    depth += {"(": 1, ")": -1}.get(body[i], 0)
                    i += 1
                lineno = text[: block.start(1) + match.start()].count("\n") + 1
                yield f"{path.name}:{lineno}", match.group(1), body[match.end() : i - 1]


def check_span(name, args):
    """None when the span agrees with the code, else what differs."""
    actual = resolve(name)
    if any(e in args for e in ELLIPSIS):
        names = [n for n in (item.split("=", 1)[0].strip() for item in split_top_level(args)) if n.isidentifier()]
        order = [p.name for p in actual if p.name]
        missing = [n for n in names if n not in order]
        if missing:
            return f"not parameters of {name}: {missing}"
        if [order.index(n) for n in names] != sorted(order.index(n) for n in names):
            return f"out of order for {name}: {names}"
        return None
    documented = parse_doc_params(args)
    if documented != actual:
        return f"{name}: documented ({', '.join(map(repr, documented))}), code ({', '.join(map(repr, actual))})"
    return None


def test_every_documented_signature_matches_the_code():
    spans = list(doc_spans())
    assert len(spans) >= len(PUBLIC)
    problems = [f"{where}: {problem}" for where, name, args in spans if (problem := check_span(name, args))]
    assert not problems, "\n".join(problems)


def test_the_readme_lists_every_entry_point_in_full():
    full = {
        name for where, name, args in doc_spans() if where.startswith("README") and not any(e in args for e in ELLIPSIS)
    }
    assert set(PUBLIC) <= full, sorted(set(PUBLIC) - full)


def test_keyword_arguments_in_the_examples_exist():
    problems = []
    calls = list(code_calls())
    assert calls
    for where, name, args in calls:
        params = resolve(name)
        names = {p.name for p in params if p.kind != "**"}
        if name.endswith("kda_prefill_cp"):  # **options go to kda_prefill
            names |= {p.name for p in resolve("cula_aot.kda_prefill")}
        for item in split_top_level(re.sub(r"#[^\n]*", "", args)):
            keyword = re.match(r"(\w+)\s*=(?!=)", item)
            if keyword and keyword.group(1) not in names:
                problems.append(f"{where}: {name} has no parameter {keyword.group(1)!r}")
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize(
    "wrong",
    [
        "q, k, v, g, beta, *, A_log=None",  # parameters missing
        "q, k, v, beta, g, *, state_pool, state_indices",  # excerpt-free and reordered
    ],
)
def test_a_wrong_row_is_caught(wrong):
    assert check_span("cula_aot.kda_decode", wrong) is not None
    assert check_span("cula_aot.kda_decode", "q, k, v, g, beta, ..., state_pool, status") is None
    assert check_span("cula_aot.kda_decode", "q, ..., status, state_pool") is not None  # excerpt out of order
    assert check_span("cula_aot.kda_decode", "q, ..., checkpoint_every") is not None  # not a parameter
