"""Facts read out of SGLang's source with `ast` (never imported): each with its file and line.

What is read, per version (paths inside the wheel, under `sglang/srt/`):

- `entrypoints/http_server.py`: the route table (`@app.get/post/put/api_route` decorators: method,
  path, the handler's name and auth level), which routes are deprecated stubs (the handler only
  raises a 404 saying "deprecated") or deprecated aliases (it logs a "deprecated" warning and
  answers), and the keys of the dicts `/model_info`, `/update_weights_from_disk` and
  `_create_error_response` answer with;
- `managers/io_struct.py`: the fields of the request structures (class-level annotations, the
  base classes' included) and the values of `Literal[...]` fields;
- `sampling/sampling_params.py`: the keys `SamplingParams` takes (what `/generate`'s
  `sampling_params` may hold; an unknown key is a TypeError there);
- `managers/*.py`, `utils/weight_versions.py`: the keys `/generate`'s answer and its `meta_info`
  are built with (dict literals holding "meta_info", `meta_info[...] =`, `meta_info.update`), and
  the keys of list entries such as `meta_info["weight_versions"]`;
- `managers/schedule_batch.py`: the `FINISH_*.to_json()` keys and `type` values;
- `server_args.py` and `arg_groups/**`: the server flags, from `A[type, Arg(...)]` field
  annotations (flag = `--` + the name with dashes, plus `aliases`; `bool` is a store_true switch)
  and from explicit `parser.add_argument(...)` calls.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass, field

from devkit.sglang.source import WheelSource

HTTP_SERVER = "sglang/srt/entrypoints/http_server.py"
IO_STRUCT = "sglang/srt/managers/io_struct.py"
SAMPLING_PARAMS = "sglang/srt/sampling/sampling_params.py"
SCHEDULE_BATCH = "sglang/srt/managers/schedule_batch.py"
WEIGHT_VERSIONS = "sglang/srt/utils/weight_versions.py"
SERVER_ARGS = "sglang/srt/server_args.py"
ARG_GROUPS = "sglang/srt/arg_groups/"
MANAGERS = "sglang/srt/managers/"
_APP_METHODS = {"get": "GET", "post": "POST", "put": "PUT", "delete": "DELETE"}


@dataclass(frozen=True)
class Fact:
    """One name SGLang defines: where (file inside the wheel, line) and what else is known."""

    name: str
    file: str
    line: int
    tags: frozenset[str] = frozenset()  # e.g. "deprecated-stub", "admin", "switch"
    choices: tuple[str, ...] = ()  # Literal values of a field, argparse choices of a flag
    handler: str = ""  # a route's function

    @property
    def where(self) -> str:
        return f"{self.file}:{self.line}"


@dataclass
class SGLangFacts:
    version: str
    # kind -> name -> fact. Kinds: "route" ("POST /generate"), a class name of io_struct.py or
    # "SamplingParams" (its fields), "generate_response", "meta_info", "meta_info.<key>[]",
    # "model_info", "update_weights_response", "error_response", "finish_reason", "finish_type",
    # "flag" ("--tp-size").
    kinds: dict[str, dict[str, Fact]] = field(default_factory=dict)
    # kind -> where its names are defined ("io_struct.py:1776 class PauseGenerationReqInput"),
    # for a message about a name that is missing.
    anchors: dict[str, str] = field(default_factory=dict)

    def of(self, kind: str) -> dict[str, Fact]:
        return self.kinds.get(kind, {})

    def add(self, kind: str, fact: Fact) -> None:
        self.kinds.setdefault(kind, {}).setdefault(fact.name, fact)

    def anchor(self, kind: str) -> str:
        return self.anchors.get(kind, "nowhere in the files read")


def _const_str(node: ast.AST | None) -> str | None:
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None


def _strings(node: ast.AST | None) -> list[str]:
    if isinstance(node, ast.List | ast.Tuple | ast.Set):
        return [s for s in (_const_str(e) for e in node.elts) if s is not None]
    return []


def _texts(node: ast.AST) -> list[str]:
    """Every string constant under `node`, f-string parts included."""
    return [n.value for n in ast.walk(node) if isinstance(n, ast.Constant) and isinstance(n.value, str)]


# --- routes --------------------------------------------------------------------------------------


def _route_tags(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> set[str]:
    tags: set[str] = set()
    for dec in fn.decorator_list:
        if isinstance(dec, ast.Call) and getattr(dec.func, "id", "") == "auth_level":
            level = ast.unparse(dec.args[0]) if dec.args else ""
            if "ADMIN" in level:
                tags.add("admin")
    body = [s for s in fn.body if not (isinstance(s, ast.Expr) and _const_str(s.value) is not None)]
    raises_404 = any(
        isinstance(s, ast.Raise)
        and "404" in ast.unparse(s)
        and any("deprecated" in t.lower() for t in _texts(s))
        for s in body
    )
    if raises_404 and len(body) == 1:
        tags.add("deprecated-stub")
    else:
        warns = any(
            isinstance(n, ast.Call)
            and isinstance(n.func, ast.Attribute)
            and n.func.attr in ("warning", "warn")
            and any("deprecated" in t.lower() for t in _texts(n))
            for n in ast.walk(fn)
        )
        if warns:
            tags.add("deprecated-alias")
    return tags


def read_routes(src: WheelSource, facts: SGLangFacts) -> None:
    tree = ast.parse(src.read(HTTP_SERVER))
    facts.anchors["route"] = f"{HTTP_SERVER} (the @app routes)"
    for fn in ast.walk(tree):
        if not isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        tags = _route_tags(fn)
        for dec in fn.decorator_list:
            if not (isinstance(dec, ast.Call) and isinstance(dec.func, ast.Attribute)):
                continue
            if getattr(dec.func.value, "id", "") != "app" or not dec.args:
                continue
            path = _const_str(dec.args[0])
            if path is None:
                continue  # a route named by an env var (the Ollama / Vertex ones)
            if dec.func.attr in _APP_METHODS:
                methods = [_APP_METHODS[dec.func.attr]]
            elif dec.func.attr == "api_route":
                given = next((k.value for k in dec.keywords if k.arg == "methods"), None)
                methods = _strings(given) or ["GET"]
            else:
                continue
            for method in methods:
                facts.add(
                    "route",
                    Fact(f"{method} {path}", HTTP_SERVER, dec.lineno, frozenset(tags), handler=fn.name),
                )


# --- dict keys -----------------------------------------------------------------------------------


def _dict_keys(node: ast.AST, file: str) -> list[Fact]:
    return [
        Fact(k.value, file, k.lineno)
        for d in ast.walk(node)
        if isinstance(d, ast.Dict)
        for k in d.keys
        if isinstance(k, ast.Constant) and isinstance(k.value, str)
    ]


def _function(tree: ast.AST, name: str) -> ast.FunctionDef | ast.AsyncFunctionDef | None:
    return next(
        (
            n
            for n in ast.walk(tree)
            if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef) and n.name == name
        ),
        None,
    )


def read_answer_keys(src: WheelSource, facts: SGLangFacts) -> None:
    tree = ast.parse(src.read(HTTP_SERVER))
    for kind, handler in (
        ("model_info", "model_info"),
        ("update_weights_response", "update_weights_from_disk"),
        ("error_response", "_create_error_response"),
    ):
        fn = _function(tree, handler)
        if fn is None:
            continue
        facts.anchors[kind] = f"{HTTP_SERVER}:{fn.lineno} {handler}()"
        for fact in _dict_keys(fn, HTTP_SERVER):
            facts.add(kind, fact)
        for node in ast.walk(fn):  # result["key"] = ... after the literal
            if isinstance(node, ast.Assign):
                for target in node.targets:
                    if isinstance(target, ast.Subscript) and (key := _const_str(target.slice)):
                        facts.add(kind, Fact(key, HTTP_SERVER, target.lineno))


def _is_meta_info(node: ast.AST) -> bool:
    return isinstance(node, ast.Name) and node.id == "meta_info"


def read_generate_answer(src: WheelSource, facts: SGLangFacts) -> None:
    """The keys of `/generate`'s answer and of its `meta_info`, wherever they are set."""
    files = [p for p in src.paths(MANAGERS) if p.endswith(".py")]
    if src.has(WEIGHT_VERSIONS):
        files.append(WEIGHT_VERSIONS)
    for kind in ("generate_response", "meta_info", "meta_info.weight_versions[]"):
        facts.anchors[kind] = f"{MANAGERS} and {WEIGHT_VERSIONS} (where meta_info is built)"
    for file in files:
        tree = ast.parse(src.read(file))
        for node in ast.walk(tree):
            if isinstance(node, ast.Dict):
                keys = [_const_str(k) for k in node.keys]
                if "meta_info" in keys and "output_ids" in keys:
                    for k in node.keys:
                        if key := _const_str(k):
                            facts.add("generate_response", Fact(key, file, k.lineno))
            elif isinstance(node, ast.Assign):
                for target in node.targets:
                    if _is_meta_info(target) and isinstance(node.value, ast.Dict):
                        for fact in _dict_keys(node.value, file):
                            facts.add("meta_info", fact)
                    elif (
                        isinstance(target, ast.Subscript)
                        and _is_meta_info(target.value)
                        and (key := _const_str(target.slice))
                    ):
                        facts.add("meta_info", Fact(key, file, target.lineno))
                        if isinstance(node.value, ast.ListComp) and isinstance(node.value.elt, ast.Dict):
                            for fact in _dict_keys(node.value.elt, file):
                                facts.add(f"meta_info.{key}[]", fact)
            elif (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr == "update"
                and _is_meta_info(node.func.value)
            ):
                for arg in node.args:
                    if isinstance(arg, ast.Dict):
                        for fact in _dict_keys(arg, file):
                            facts.add("meta_info", fact)
                for kw in node.keywords:
                    if kw.arg:
                        facts.add("meta_info", Fact(kw.arg, file, node.lineno))


def read_finish_reasons(src: WheelSource, facts: SGLangFacts) -> None:
    tree = ast.parse(src.read(SCHEDULE_BATCH))
    facts.anchors["finish_reason"] = facts.anchors["finish_type"] = f"{SCHEDULE_BATCH} FINISH_*.to_json()"
    for cls in tree.body:
        if not (isinstance(cls, ast.ClassDef) and cls.name.startswith("FINISH")):
            continue
        to_json = _function(cls, "to_json")
        if to_json is None:
            continue
        for d in ast.walk(to_json):
            if isinstance(d, ast.Dict):
                for k, v in zip(d.keys, d.values, strict=True):
                    if key := _const_str(k):
                        facts.add("finish_reason", Fact(key, SCHEDULE_BATCH, k.lineno))
                        if key == "type" and (kind := _const_str(v)):
                            facts.add("finish_type", Fact(kind, SCHEDULE_BATCH, v.lineno))


# --- structures ----------------------------------------------------------------------------------


def _literal_values(annotation: ast.AST) -> tuple[str, ...]:
    for node in ast.walk(annotation):
        if isinstance(node, ast.Subscript) and getattr(node.value, "id", "") == "Literal":
            inner = node.slice
            elts = inner.elts if isinstance(inner, ast.Tuple) else [inner]
            return tuple(s for s in (_const_str(e) for e in elts) if s is not None)
    return ()


def _class_fields(classes: dict[str, ast.ClassDef], name: str, file: str) -> list[Fact]:
    cls = classes[name]
    fields: list[Fact] = []
    for base in cls.bases:  # fields of a base class defined in the same file come first
        if isinstance(base, ast.Name) and base.id in classes:
            fields.extend(_class_fields(classes, base.id, file))
    for stmt in cls.body:
        if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
            if "ClassVar" in ast.unparse(stmt.annotation):
                continue
            fields.append(Fact(stmt.target.id, file, stmt.lineno, choices=_literal_values(stmt.annotation)))
    init = _function(cls, "__init__")
    if init is not None and init in cls.body:
        for arg in [*init.args.args[1:], *init.args.kwonlyargs]:
            fields.append(Fact(arg.arg, file, arg.lineno))
    return fields


def read_structures(src: WheelSource, facts: SGLangFacts) -> None:
    for file in (IO_STRUCT, SAMPLING_PARAMS, WEIGHT_VERSIONS):
        if not src.has(file):
            continue
        tree = ast.parse(src.read(file))
        classes = {c.name: c for c in tree.body if isinstance(c, ast.ClassDef)}
        for name, cls in classes.items():
            facts.anchors[name] = f"{file}:{cls.lineno} class {name}"
            for fact in _class_fields(classes, name, file):
                facts.add(name, fact)


# --- server flags --------------------------------------------------------------------------------


def _module_lists(tree: ast.Module) -> dict[str, tuple[str, ...]]:
    """Module-level `NAME = ["a", "b"]`: argparse choices are often named this way."""
    out = {}
    for stmt in tree.body:
        if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name):
            values = _strings(stmt.value)
            if values:
                out[stmt.targets[0].id] = tuple(values)
    return out


def _choices(node: ast.AST | None, lists: dict[str, tuple[str, ...]]) -> tuple[str, ...]:
    if node is None:
        return ()
    if isinstance(node, ast.Name):
        return lists.get(node.id, ())
    return tuple(_strings(node))


def read_flags(src: WheelSource, facts: SGLangFacts) -> None:
    files = [SERVER_ARGS, *src.paths(ARG_GROUPS)]
    facts.anchors["flag"] = f"{SERVER_ARGS} and {ARG_GROUPS} (A[...] fields, add_argument calls)"
    for file in files:
        if not src.has(file):
            continue
        tree = ast.parse(src.read(file))
        lists = _module_lists(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                for stmt in node.body:
                    _annotated_flag(stmt, file, lists, facts)
            elif (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr == "add_argument"
            ):
                names = [s for s in (_const_str(a) for a in node.args) if s and s.startswith("--")]
                kw = {k.arg: k.value for k in node.keywords if k.arg}
                action = _const_str(kw.get("action")) or ""
                tags = frozenset({"switch"}) if action in ("store_true", "store_false") else frozenset()
                for name in names:
                    facts.add("flag", Fact(name, file, node.lineno, tags, _choices(kw.get("choices"), lists)))


def _annotated_flag(stmt: ast.stmt, file: str, lists: dict[str, tuple[str, ...]], facts: SGLangFacts) -> None:
    """`name: A[type, "help" | Arg(...), ...] = default` -> `--name` (and its aliases)."""
    if not (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)):
        return
    ann = stmt.annotation
    if not (isinstance(ann, ast.Subscript) and getattr(ann.value, "id", "") in ("A", "Annotated")):
        return
    parts = ann.slice.elts if isinstance(ann.slice, ast.Tuple) else [ann.slice]
    if not parts:
        return
    kind = ast.unparse(parts[0])
    arg = next((p for p in parts[1:] if isinstance(p, ast.Call) and getattr(p.func, "id", "") == "Arg"), None)
    kw = {k.arg: k.value for k in arg.keywords if k.arg} if arg is not None else {}
    if isinstance(kw.get("no_cli"), ast.Constant) and kw["no_cli"].value is True:
        return
    action = _const_str(kw.get("action")) or ""
    switch = kind == "bool" or action in ("store_true", "store_false")
    tags = frozenset({"switch"}) if switch else frozenset()
    choices = _choices(kw.get("choices"), lists) or _literal_values(parts[0])
    names = [f"--{stmt.target.id.replace('_', '-')}", *_strings(kw.get("aliases"))]
    for name in names:
        facts.add("flag", Fact(name, file, stmt.lineno, tags, choices))


def read(src: WheelSource) -> SGLangFacts:
    """Every fact above for one version."""
    facts = SGLangFacts(src.version)
    read_routes(src, facts)
    read_answer_keys(src, facts)
    read_generate_answer(src, facts)
    read_finish_reasons(src, facts)
    read_structures(src, facts)
    read_flags(src, facts)
    return facts
