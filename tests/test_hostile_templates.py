"""Hostile chat templates end in a one-line `ChatTemplateError`, in bounded time and memory.

Issue 13 item 6: nested `range(100000)` loops hung the server, `'x' * 10**9` took it to
19.5 GB, and a big integer power crashed while compiling. Limits are set small here so every
case ends in well under a second; the defaults are checked on the worst cases in a
subprocess, whose peak RSS must stay far below what the unbounded operations would take.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import jinja2
import jinja2.ext
import pytest
from jinja2.sandbox import ImmutableSandboxedEnvironment

from ninfer_core.text.chat_template import ChatTemplate, ChatTemplateError
from ninfer_core.text.template_sandbox import RenderLimits

MESSAGES = [{"role": "user", "content": "hi"}]
#: Small enough that each case stops fast; the deadline only proves "it terminates".
SMALL = RenderLimits(
    max_chars=1 << 20,
    max_total_chars=8 << 20,
    max_items=1 << 16,
    max_iterations=200_000,
    max_seconds=10.0,
)


def render(source: str, limits: RenderLimits = SMALL, **kwargs) -> str:
    return ChatTemplate(source, limits=limits).render(MESSAGES, **kwargs)


def refused(source: str, match: str, limits: RenderLimits = SMALL) -> str:
    with pytest.raises(ChatTemplateError, match=match) as info:
        render(source, limits)
    message = str(info.value)
    assert "\n" not in message, message
    return message


# --- what honest templates use still renders as plain Jinja renders it -----------------

BENIGN = """\
{%- set ns = namespace(n=0, names=[]) -%}
{%- for m in messages %}{% set ns.n = ns.n + 1 %}<{{ m.role }}>{{ m.content | trim }}
{% endfor -%}
{{ tools | map(attribute='name') | join(', ') }}|{{ [1, 2, 3] | sum }}
{{ 'a\nb' | indent(2, true) }}
{{ 'x' | center(5) }}|{{ '%s-%03d' | format('a', 7) }}|{{ 'aXb' | replace('X', 'yy') }}
{{ 'one two three' | wordwrap(5) }}|{{ 'a,b'.split(',') }}|{{ '{}={:>4}'.format('k', 1) }}
{{ '-'.join(['p', 'q']) }}|{{ 'ab' * 3 }}|{{ [0] * 3 + [1] }}|{{ 2 ** 10 }}|{{ 7 % 3 }}
{{ '%d%%' % 50 }}|{{ 'a' ~ 1 ~ [2] }}|{{ range(3) | list }}|{{ ns.n }}|{{ 'abc'[::-1] }}
{%- for x in [[1, [2]], [3]] recursive %}{{ x if x is number else loop(x) }}{% endfor %}
{%- macro tag(t) %}<{{ t }}>{% endmacro %}{{ tag('m') }}{% set block %}B{{ 1 }}{% endset %}
{{- block }}{% for i in range(5) %}{% if i > 2 %}{% break %}{% endif %}{{ i }}{% endfor %}
{% for x in 'abc' %}{{ loop.index }}/{{ loop.length }}{{ loop.revindex }}{{ loop.last }}
{{- loop.previtem }}{{ loop.nextitem }}{{ loop.cycle('o', 'e') }}{% else %}none{% endfor %}
{%- for x in [] %}{{ x }}{% else %}empty{% endfor %}{% for k, v in {'a': 1}.items() %}{{ k }}
{{- v }}{% endfor %}{% for m in messages if m.role == 'user' %}{{ loop.index }}{% endfor %}
{{- messages | length }}{{ {'k': [1, 2]} | tojson }}{{ 'Title' | lower | upper }}"""


def test_benign_features_render_like_plain_jinja():
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    variables = {"tools": [{"name": "a"}, {"name": "b"}], "add_generation_prompt": False}
    expected = env.from_string(BENIGN).render(messages=MESSAGES, **variables)
    got = ChatTemplate(BENIGN).render(MESSAGES, tools=variables["tools"])
    assert got == expected


# --- the cases of the issue ------------------------------------------------------------


def test_nested_loops_with_output_stop_at_the_iteration_limit():
    source = "{% for i in range(100000) %}{% for j in range(100000) %}x{% endfor %}{% endfor %}"
    refused(source, "loops ran more than 200,000 iterations")


def test_nested_loops_without_output_stop_too():
    source = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
    refused(source, "loops ran more than 200,000 iterations")


def test_the_deadline_stops_a_render_the_counts_allow():
    # An iteration budget no honest template reaches, so only the clock can stop it.
    limits = RenderLimits(max_iterations=10**12, max_seconds=0.2)
    source = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
    refused(source, r"rendering took longer than 0\.2 s", limits)


def test_recursive_loops_are_counted():
    source = (
        "{% for x in range(1000) recursive %}"
        "{% if loop.depth < 4 %}{{ loop(range(1000)) }}{% endif %}{% endfor %}"
    )
    refused(source, "iterations")


@pytest.mark.parametrize(
    "source, match",
    [
        ("{{ 'x' * 10**9 }}", "repeating a str of length 1 1,000,000,000 times"),
        ("{{ 10**9 * 'x' }}", "repeating a str"),
        ("{{ [0] * 10**9 }}", "repeating a list"),
        ("{{ 2**(10**8) }}", "a power would have about 200,000,000 bits"),
        ("{{ 2**100000 }}", "a power"),
        (
            "{% set ns = namespace(x=3) %}{% for i in range(64) %}{% set ns.x = ns.x * ns.x %}"
            "{% endfor %}",
            "a product",
        ),
        (
            "{% set ns = namespace(s='xx') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}"
            "{% endfor %}",
            "concatenation would be over",
        ),
        (
            "{% set ns = namespace(s='xx') %}{% for i in range(64) %}{% set ns.s = ns.s + ns.s %}"
            "{% endfor %}",
            "a sum of length",
        ),
        ("{{ 'x' | center(10**9) }}", "argument of 1,000,000,000"),
        ("{{ '%01000000000d' % 1 }}", "a % format would be over"),
        ("{{ '%0*d' % (10**9, 1) }}", r"a '\*' width"),
        ("{{ '{:>1000000000}'.format(1) }}", "str.format would be over"),
        ("{{ '%s' | format(['x' * 1000] * 2000) }}", "the format filter would be over"),
        ("{{ ('x' * 1000000).replace('x', 'xx') }}", "str.replace would be over"),
        ("{{ ['x' * 1000] * 2000 }}", "an output value would be over"),
        ("{{ (['x' * 1000] * 2000) | join(',') }}", "the join filter's input"),
        ("{{ ','.join(['x' * 1000] * 2000) }}", "str.join would be over"),
        (
            "{{ 'a' | wordwrap(1, wrapstring='b' * 1000000) }}{{ 'a b c d' | wordwrap(1, "
            "wrapstring='b' * 1000000) }}",
            "the wordwrap filter would be over",
        ),
        ("{{ messages | tojson(indent=10**7) }}", "argument of 10,000,000"),
        ("{{ messages | tojson(indent=100) }}", "tojson indent of 100"),
        ("{{ range(10) | sum(start=[]) }}", "adds numbers only"),
        ("{{ range(10**6) | list }}", r"range\(\) of 1,000,000 elements"),
        ("{{ ('x ' * 100000).split() | length }}", "split into"),
        ("{{ strftime_now('%c' * 1000) }}", "strftime format"),
        ("{{ lipsum(10**6) }}", "lipsum"),
        (
            "{% macro f() %}{% for i in range(100) %}{{ 'y' * 100000 }}{% endfor %}{% endmacro %}"
            "{{ f() }}",
            "block's output would be over|built more than",
        ),
        (
            "{% set ns = namespace(l=[]) %}{% for i in range(10000) %}"
            "{% set ns.l = ns.l + ['x' * 1000 ~ i] %}{% endfor %}",
            "built more than",
        ),
    ],
    ids=lambda v: v[:40] if isinstance(v, str) else None,
)
def test_hostile_operation_is_refused_in_one_line(source, match):
    message = refused(source, match)
    assert message.startswith("chat template 'default'")


def test_output_limit_is_checked_while_rendering():
    limits = RenderLimits(max_chars=1000, max_iterations=10**9)
    refused("{% for i in range(100000) %}x{% endfor %}", "output passed 1,000 characters", limits)


def test_compile_time_failures_are_one_line():
    # The parser recursing too deep, a source over the limit: refused, never a traceback.
    refused("{{" + "(" * 100_000 + "1" + ")" * 100_000 + "}}", "does not compile|does not parse")
    refused("x" * 2000, "2,000 characters", RenderLimits(max_source_chars=1000))
    # Constants are not folded at compile time (`**` is intercepted), so this compiles and
    # fails at render with the sandbox's message instead of crashing the compiler.
    ChatTemplate("{{ 2**100000 }}")._compile("default")


def test_limits_are_per_render():
    template = ChatTemplate("{% for i in range(1000) %}{% endfor %}ok", limits=SMALL)
    for _ in range(300):  # 300k iterations in all: over the limit only if it accumulated
        assert template.render(MESSAGES) == "ok"


WORST = {
    "nested-loops": "{% for i in range(100000) %}{% for j in range(100000) %}x{% endfor %}"
    "{% endfor %}",
    "repeat": "{{ 'x' * 10**9 }}",
    "power": "{{ 2**(10**8) }}",
    "kept-strings": "{% set ns = namespace(s='x' * 1000000, l=[]) %}{% for i in range(100000) %}"
    "{% set ns.l = ns.l + [ns.s ~ i] %}{% endfor %}",
    "macro-output": "{% macro f() %}{% for i in range(100000) %}{{ 'y' * 100000 }}{% endfor %}"
    "{% endmacro %}{{ f() }}",
}


@pytest.mark.parametrize("source", WORST.values(), ids=WORST.keys())
def test_default_limits_bound_memory_and_time(source):
    """With the default limits, in a fresh process: refused, within a generous memory bound
    (the unbounded cases take 1-20 GB), and the process ends (the timeout is generous)."""
    script = textwrap.dedent(
        """
        import sys
        from ninfer_core.text.chat_template import ChatTemplate, ChatTemplateError
        try:
            ChatTemplate(sys.argv[1]).render([{"role": "user", "content": "hi"}])
            print("RENDERED")
        except ChatTemplateError as exc:
            print("REFUSED", exc)
        status = open("/proc/self/status").read()
        print("HWM", next(l.split()[1] for l in status.splitlines() if l.startswith("VmHWM")))
        """
    )
    run = subprocess.run(
        [sys.executable, "-c", script, source], capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    assert lines[0].startswith("REFUSED chat template 'default' was stopped:"), run.stdout
    assert int(lines[1].split()[1]) < 1024 * 1024, run.stdout  # VmHWM in kB: under 1 GiB


# --- through the server ------------------------------------------------------------------


@pytest.mark.usefixtures("one_torch_thread")
def test_server_answers_400_and_stays_up(tmp_path):
    """A hostile template fails its request with a 400 that says why; the server goes on
    serving (a raw completion, /health) instead of hanging."""
    import httpx
    from serve_fixtures import MODEL_ID, frontends_host, make_state, serving, write_serve_model

    state = make_state(write_serve_model(tmp_path / "model"))
    nested = "{% for i in range(100000) %}{% for j in range(100000) %}x{% endfor %}{% endfor %}"
    chat = {"model": MODEL_ID, "messages": MESSAGES, "max_tokens": 2}
    with (
        serving(state, frontends_host(anthropic=False)) as srv,
        httpx.Client(timeout=60) as http,
    ):
        for source, says in (
            (nested, "loops ran more than 200,000 iterations"),
            ("{{ 'x' * 10**9 }}", "repeating a str"),
        ):
            state.template = ChatTemplate(source, limits=SMALL)
            answer = http.post(srv.url + "/v1/chat/completions", json=chat)
            assert answer.status_code == 400, answer.text
            assert says in answer.json()["error"]["message"]
        raw = {"model": MODEL_ID, "prompt": "hello", "max_tokens": 2}
        assert http.post(srv.url + "/v1/completions", json=raw).status_code == 200
        assert http.get(srv.url + "/health").status_code == 200
