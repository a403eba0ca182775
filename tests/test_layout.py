"""The direction of imports, read from the source: the layout docs/architecture.md draws is the one the code has.

Why a test: a layer boundary that only a document states erodes one convenient import at a time. Each rule here
is checked over every import in the tree, those inside functions included (a lazy import still ties two rooms
together), and transitively: the engine may not reach gRPC through a helper that does.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("kvtransfer", "decode_server", "prefill_server", "api_server", "router", "bench", "proto")
RPC = ("grpc", "grpc_health", "grpc_reflection", "google.protobuf", "proto")
HTTP = ("fastapi", "starlette", "uvicorn", "aiohttp", "httpx")


def _modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for path in (ROOT / pkg).rglob("*.py"):
            if "results" in path.parts:
                continue
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            out[name.removesuffix(".__init__")] = path
    return out


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """Every module `name` imports, anywhere in its file: project modules by name, others by their top name
    (google.protobuf by two)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            subs = [f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in modules]
            # `from package import module` runs the package's __init__ before anything else imports the module
            # from it: only the module is this file's import (the package counts when a name comes from it)
            targets = subs + ([base] if len(subs) < len(node.names) else [])
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in modules:
            targets = [node.value]  # a module named to importlib (the transport registry's lazy backends)
        else:
            continue
        for t in targets:
            if t in modules:
                found.add(t)
            elif t.split(".")[0] not in PACKAGES or t.split(".")[0] == "proto":
                found.add(".".join(t.split(".")[:2]) if t.startswith("google.") else t.split(".")[0])
    found.discard(name)
    return found


def graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def reach(g: dict[str, set[str]], start: str) -> set[str]:
    """Everything `start` imports, directly or through project modules."""
    seen, todo = set(), [start]
    while todo:
        for nxt in g.get(todo.pop(), ()):
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


def _within(name: str, *prefixes: str) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def violations(g: dict[str, set[str]], rooms: tuple[str, ...], banned: tuple[str, ...]) -> list[str]:
    return sorted(f"{m} -> {', '.join(sorted(b for b in reach(g, m) if _within(b, *banned)))}"
                  for m in g if _within(m, *rooms) and any(_within(b, *banned) for b in reach(g, m)))


@pytest.fixture(scope="module")
def g():
    return graph()


# The rooms in the order they may import each other: a module imports only from its own room or rooms before it
# (docs/architecture.md, "Folder layout"). Rooms of one rank do not import each other (rules below).
RANKS = [(0, ("kvtransfer.geometry", "kvtransfer.determinism", "proto")), (1, ("kvtransfer.kernels",)),
         (2, ("kvtransfer.model",)), (3, ("kvtransfer.rpc",)), (4, ("kvtransfer.transport", "kvtransfer.engine")),
         (5, ("prefill_server", "decode_server", "api_server", "router")), (6, ("bench",))]


def rank(module: str) -> int | None:
    return next((r for r, rooms in RANKS if _within(module, *rooms)), None)


def upward(g: dict[str, set[str]]) -> list[str]:
    return sorted(f"{m} -> {d}" for m, deps in g.items() for d in deps
                  if rank(m) is not None and rank(d) is not None and rank(d) > rank(m))


def test_every_room_imports_only_rooms_before_it(g):
    assert [m for m in g if _within(m, *PACKAGES) and m not in PACKAGES and rank(m) is None] == []
    assert upward(g) == []


def test_the_engine_imports_no_rpc_http_or_transport(g):
    assert violations(g, ("kvtransfer.engine",), RPC + HTTP + ("kvtransfer.rpc", "kvtransfer.transport")) == []


def test_the_model_and_kernels_import_no_rpc_transport_or_engine(g):
    assert violations(g, ("kvtransfer.model", "kvtransfer.kernels"),
                      RPC + HTTP + ("kvtransfer.transport", "kvtransfer.engine", "kvtransfer.rpc")) == []


def test_transports_import_no_model_code(g):
    assert violations(g, ("kvtransfer.transport",), ("transformers", "kvtransfer.model", "kvtransfer.engine")) == []


def test_nothing_in_the_core_imports_a_server_or_the_bench(g):
    assert violations(g, ("kvtransfer",), ("decode_server", "prefill_server", "api_server", "bench")) == []


def test_the_servers_do_not_import_each_other_or_the_bench(g):
    assert violations(g, ("decode_server",), ("prefill_server", "api_server", "bench")) == []
    assert violations(g, ("prefill_server",), ("decode_server", "api_server", "bench")) == []


# The HTTP front talks to a decode server over gRPC only: it shares kvtransfer.rpc (flags, security) and proto,
# never the engine, the model, a transport or torch (a front that loaded them would compete for the GIL and the
# memory that it exists to keep away from the decode engine; docs/api.md).
API_BANNED = ("decode_server", "prefill_server", "bench", "kvtransfer.engine", "kvtransfer.model",
              "kvtransfer.transport", "kvtransfer.kernels", "torch")


def test_the_http_front_speaks_to_the_decode_server_over_grpc_only(g):
    assert violations(g, ("api_server",), API_BANNED) == []


# The router (docs/router.md) is a front too: gRPC to the decode workers, and of the engine only the prefix index's
# block keys (numpy and hashlib), so a prompt's cached prefix is named by the keys the workers use.
ROUTER_BANNED = ("decode_server", "prefill_server", "api_server", "bench", "kvtransfer.model",
                 "kvtransfer.transport", "kvtransfer.kernels", "torch", "transformers")


def test_the_router_speaks_to_the_workers_over_grpc_only(g):
    assert violations(g, ("router",), ROUTER_BANNED) == []
    engine = {d for m in g if _within(m, "router") for d in reach(g, m) if _within(d, "kvtransfer.engine")}
    assert engine <= {"kvtransfer.engine", "kvtransfer.engine.prefix_index"}, engine
    assert violations(g, ("decode_server", "prefill_server", "api_server", "kvtransfer"), ("router",)) == []


def test_nothing_imports_the_bench_command_line(g):
    assert [m for m, deps in g.items() if "bench.cli" in deps] == []


def cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index, low, on, stack, out, counter = {}, {}, set(), [], [], [0]
    for root in g:
        if root in index:
            continue
        work = [(root, iter(sorted(g[root])))]
        index[root] = low[root] = counter[0]
        counter[0] += 1
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            for w in it:
                if w not in g:
                    continue
                if w not in index:
                    index[w] = low[w] = counter[0]
                    counter[0] += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(g[w]))))
                    break
                if w in on:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = []
                    while True:
                        w = stack.pop()
                        on.discard(w)
                        comp.append(w)
                        if w == v:
                            break
                    if len(comp) > 1:
                        out.append(sorted(comp))
    return out


def test_no_import_cycle_anywhere(g):
    assert cycles(g) == []


def test_the_checks_see_a_planted_import():
    """The rules above are only worth what they catch: a planted wrong import, found in each direction."""
    g = graph()
    g["kvtransfer.engine.sampler"] = g["kvtransfer.engine.sampler"] | {"kvtransfer.rpc.server"}
    assert violations(g, ("kvtransfer.engine",), RPC) != []
    g = graph()
    g["kvtransfer.engine.sampler"] = g["kvtransfer.engine.sampler"] | {"kvtransfer.rpc.limits"}  # no grpc in it
    assert violations(g, ("kvtransfer.engine",), ("kvtransfer.rpc",)) != []
    g = graph()
    g["kvtransfer.transport.layout"] = g["kvtransfer.transport.layout"] | {"kvtransfer.model.streaming"}
    assert violations(g, ("kvtransfer.transport",), ("transformers",)) != []
    g = graph()
    g["kvtransfer.engine.pool"] = g["kvtransfer.engine.pool"] | {"kvtransfer.engine.scheduler"}
    assert cycles(g) != []
    g = graph()
    g["kvtransfer.rpc.limits"] = g["kvtransfer.rpc.limits"] | {"kvtransfer.transport.errors"}
    assert upward(g) != []
    assert any(d.startswith("kvtransfer.transport.grpc") for d in g["kvtransfer.transport.registry"])  # lazy
    g = graph()
    g["api_server.config"] = g["api_server.config"] | {"kvtransfer.rpc.device_thread"}  # which imports torch
    assert violations(g, ("api_server",), API_BANNED) != []
    g = graph()
    g["router.placement"] = g["router.placement"] | {"kvtransfer.engine.scheduler"}  # torch, through the engine
    assert violations(g, ("router",), ROUTER_BANNED) != []
