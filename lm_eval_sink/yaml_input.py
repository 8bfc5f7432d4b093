"""YAML a user passes, parsed safely and within bounds: a hostile document is refused in one line before it is built."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from lm_eval_sink.errors import UserError

# Bounds on a YAML input, far above what a config holds (figures: docs/development.md, 'Faults').
YAML_MAX_CHARS = 1 << 20
YAML_MAX_NODES = 50_000
YAML_MAX_DEPTH = 64
YAML_MAX_DIGITS = 100


def parse_yaml(text: str, where: str) -> Any:
    """YAML text -> data (PyYAML's safe loader on libyaml, within `YAML_MAX_*`); a syntax error or a hostile document
    is a UserError naming `where` and the line."""
    import yaml

    loader_class = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # libyaml's: a megabyte parsed in milliseconds
    if len(text) > YAML_MAX_CHARS:
        raise UserError(
            f"{where}: {len(text):,} characters, more than a config may hold ({YAML_MAX_CHARS:,})",
            "pass the config itself, not a data file",
        )
    try:
        _check_yaml_events(yaml.parse(text, Loader=loader_class), where)
        loader = loader_class(text)
        try:
            node = loader.get_single_node()
            if node is None:
                return None
            _check_yaml_nodes(node, where)
            return loader.construct_document(node)
        finally:
            loader.dispose()
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        line = f":{mark.line + 1}" if mark is not None else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise UserError(f"{where}{line}: not valid YAML ({problem})", "fix the YAML syntax at that line") from None


def _check_yaml_events(events: Iterable[Any], where: str) -> None:
    """Refuse, from the parser's events (nothing built yet), a YAML document nested deeper than `YAML_MAX_DEPTH` or
    holding more than `YAML_MAX_NODES` values as written."""
    import yaml

    depth = nodes = 0
    for event in events:
        depth += isinstance(event, yaml.CollectionStartEvent) - isinstance(event, yaml.CollectionEndEvent)
        nodes += isinstance(event, yaml.NodeEvent)
        if depth > YAML_MAX_DEPTH:
            raise UserError(
                f"{where}:{event.start_mark.line + 1}: nested more than {YAML_MAX_DEPTH} levels deep",
                "write the config with a few levels of nesting",
            )
        if nodes > YAML_MAX_NODES:
            raise UserError(
                f"{where}:{event.start_mark.line + 1}: more than {YAML_MAX_NODES:,} values, more than a config holds",
                "pass the config itself, not a data file",
            )


def _check_yaml_nodes(root: Any, where: str) -> None:
    """Refuse a composed YAML document that expands (aliases followed) past `YAML_MAX_NODES` nodes, whose alias
    refers to a node holding it, or with an integer past `YAML_MAX_DIGITS` digits; each distinct node visited once."""
    import yaml

    sizes: dict[int, int] = {}
    path: set[int] = set()  # the nodes open on the walk: the current node's ancestors
    stack: list[tuple[Any, bool]] = [(root, False)]
    while stack:
        node, finished = stack.pop()
        at = f"{where}:{node.start_mark.line + 1}"
        children = [x for pair in node.value for x in pair] if isinstance(node, yaml.MappingNode) else []
        children = node.value if isinstance(node, yaml.SequenceNode) else children
        if finished:
            path.discard(id(node))
            sizes[id(node)] = 1 + sum(sizes[id(c)] for c in children)
            if sizes[id(node)] > YAML_MAX_NODES:
                raise UserError(
                    f"{at}: expands to more than {YAML_MAX_NODES:,} values (aliases repeat what they name)",
                    "write the values out, or use fewer aliases (&name / *name)",
                )
        elif id(node) in path:
            raise UserError(f"{at}: an alias refers to a value that holds it", "remove that alias (*name)")
        elif id(node) not in sizes:
            if node.tag == "tag:yaml.org,2002:int" and len(node.value) > YAML_MAX_DIGITS:
                raise UserError(f"{at}: a number of {len(node.value):,} digits", "write the value the field takes")
            path.add(id(node))
            stack.append((node, True))
            stack.extend((c, False) for c in children)
