"""The text `ninfer bench serve` builds its contexts from: small, bundled, freely licensed.

Code comes from the Python standard library of the interpreter running the bench (PSF
license; every Python install has it, so nothing is downloaded or shipped twice), with
NInfer's own sources as the fallback. The Chinese prose, prompts and tool descriptions
below were written for this project (Apache-2.0, like the rest of it). The guide's
workloads are mixed Chinese/English, and a tokenizer spends very different numbers of
tokens on the two, so a bench on English alone would misstate prefill cost per character.
"""

from __future__ import annotations

import sysconfig
from functools import cache
from pathlib import Path

#: Pure-Python standard-library modules, read in this order until a context is full.
STDLIB_FILES = (
    "argparse.py", "dataclasses.py", "difflib.py", "textwrap.py", "json/decoder.py",
    "json/encoder.py", "csv.py", "configparser.py", "shlex.py", "fractions.py",
    "statistics.py", "heapq.py", "bisect.py", "functools.py", "string.py", "pprint.py",
    "tokenize.py", "ast.py", "inspect.py", "typing.py", "pathlib.py", "zipfile.py",
    "tarfile.py", "email/message.py", "http/client.py", "urllib/parse.py", "logging/__init__.py",
    "asyncio/tasks.py", "asyncio/queues.py", "concurrent/futures/_base.py", "calendar.py",
    "enum.py", "selectors.py", "subprocess.py", "threading.py", "gettext.py", "locale.py",
    "datetime.py", "decimal.py", "_pydecimal.py", "imaplib.py", "smtplib.py", "ftplib.py",
)  # fmt: skip

#: Review notes put into the code every few dozen lines, as a colleague's comments would be.
CODE_NOTES = (
    "这里的异常处理太宽了，最好只捕获 ValueError 和 KeyError。",
    "TODO: 这个函数超过一百行，考虑拆成两个小函数，方便写单元测试。",
    "注意：这个循环在大输入下是 O(n^2)，线上日志显示最慢的一次用了 3 秒。",
    "这里返回 None 和返回空列表的语义不一样，调用方需要区分。",
    "FIXME: 线程安全问题，两个 worker 可能同时修改这个字典。",
    "性能热点：profile 结果显示 40% 的时间花在这里的字符串拼接上。",
    "这个参数名不太直观，建议改成 timeout_seconds，并在 docstring 里写清楚单位。",
    "兼容性：Python 3.11 以前没有这个 API，我们的最低版本已经是 3.11，可以直接用。",
    "这段逻辑和上面的 helper 重复了，可以合并。",
    "日志级别应该是 debug 而不是 info，否则生产环境的日志量会翻倍。",
)

#: What the user asks for after the file (the coding scenario's question).
EDIT_REQUESTS = (
    "请帮我重构上面这个文件：把最长的那个函数拆成几个小函数，保持对外接口不变，"
    "并为每个新函数写一句 docstring。Please keep the public API unchanged and show a diff.",
    "上面的代码里有一个潜在的 bug：当输入为空时会抛出异常。请找到它，解释原因，"
    "然后给出修复后的代码 (only the changed functions, with type hints)。",
    "请给这个模块加上类型注解 (PEP 484)，并把所有的 `%` 字符串格式化改成 f-string。"
    "改动较多的地方请用中文注释说明原因。",
    "我们要把这个文件迁移到 asyncio。请先列出需要改动的函数，再给出第一个函数的改写，"
    "注意不要阻塞事件循环 (no blocking I/O in coroutines)。",
)

SYSTEM_CODING = (
    "你是一名资深的 Python 工程师 (senior Python engineer)。回答要简洁、准确；修改代码时"
    "只给出必要的改动，并说明理由。Always answer in the user's language."
)

SYSTEM_AGENT = (
    "你是一个在用户的代码仓库里工作的编程助手 (a coding agent working in the user's "
    "repository)。你可以调用下面列出的工具来读取文件、搜索代码、运行测试和搜索网页。"
    "每次调用工具之前，先用一句话说明你要做什么；拿到结果以后，先判断结果是否可信，"
    "再决定下一步。不要编造文件内容或测试结果。When the task is done, summarize what you "
    "changed and why, in Chinese, with file paths and function names in English."
)

#: The agent scenario's opening request and closing question.
AGENT_TASKS = (
    "测试 `tests/test_parser.py` 在 CI 上偶尔失败，本地复现不了。请帮我查一下原因，"
    "先读相关代码，再跑一下测试。",
    "我们的服务在高并发下响应变慢。请看一下请求处理的代码路径，找出可能的瓶颈。",
    "请把配置加载从 INI 格式迁移到 TOML，保持旧的配置文件还能读。",
)
AGENT_QUESTIONS = (
    "根据上面所有工具返回的结果，问题的根本原因是什么？请给出修复方案和需要修改的文件列表。"
    " Be specific: name the functions.",
    "好的。现在请总结一下你的发现，按优先级排序，并估计每一项修改的工作量 (in hours)。",
    "这些结果里哪些是确定的，哪些只是推测？请分开列出，并说明下一步要验证什么。",
)

#: Prose for search results and notes: short paragraphs, mixed as a Chinese tech blog is.
PARAGRAPHS = (
    "在 Python 中，GIL（全局解释器锁）保证同一时刻只有一个线程执行字节码。对于 CPU 密集型"
    "任务，多线程并不能带来加速，这时应该使用 multiprocessing 或者把热点代码放到 C 扩展里。",
    "asyncio 的事件循环是单线程的：任何一个协程里的阻塞调用都会让所有其他协程停下来。"
    "常见的错误是在 async 函数里直接调用 requests.get 或者 time.sleep。",
    "缓存失效是计算机科学里最难的两件事之一。使用 functools.lru_cache 时要注意，参数必须"
    "是可哈希的，而且缓存会一直持有返回值的引用，可能导致内存泄漏。",
    "写单元测试时，不要依赖测试的执行顺序。pytest 默认按文件中的顺序执行，但并行执行"
    "（pytest-xdist）时顺序是不确定的，共享的全局状态会导致偶发失败 (flaky tests)。",
    "数据库连接池的大小不是越大越好。连接数超过数据库的处理能力以后，排队只是从应用侧"
    "转移到了数据库侧，延迟反而会上升。一个经验公式是 CPU 核数的两倍加上磁盘数。",
    "TOML 是一种为配置文件设计的格式，语义比 INI 清晰：有明确的类型（字符串、整数、"
    "布尔值、日期），支持嵌套表。Python 3.11 起标准库自带 tomllib，只能读不能写。",
    "日志要结构化 (structured logging)：每一行是一个 JSON 对象，带上 request_id，"
    "这样在高并发的情况下也能把同一个请求的日志串起来。",
    "正则表达式的灾难性回溯 (catastrophic backtracking) 会让一个看起来很简单的模式"
    "在特定输入上运行几分钟。嵌套的量词，比如 (a+)+，是最常见的原因。",
    "HTTP 的 keep-alive 可以复用 TCP 连接，省掉三次握手和 TLS 协商的时间。客户端应该"
    "复用同一个 session，而不是每个请求都新建一个连接。",
    "浮点数不能精确表示大多数十进制小数，0.1 + 0.2 != 0.3。涉及金额的计算请使用 "
    "decimal.Decimal，并且明确指定舍入方式。",
    "性能优化之前先测量。cProfile 能告诉你时间花在哪些函数上，line_profiler 能精确到行，"
    "py-spy 可以在不修改代码、不重启进程的情况下对线上服务采样。",
    "依赖版本要锁定。一个间接依赖的小版本升级就可能改变行为，锁文件能让 CI 和生产环境"
    "安装完全相同的包。",
)


@cache
def code_files() -> tuple[tuple[str, str], ...]:
    """(name, source) of the bundled code: the standard library's files above that exist on
    this interpreter, else NInfer's own modules."""
    root = Path(sysconfig.get_paths()["stdlib"])
    found = [(n, root / n) for n in STDLIB_FILES if (root / n).is_file()]
    if len(found) < 5:  # an embedded Python without its sources
        pkg = Path(__file__).resolve().parents[1]
        found = [(str(p.relative_to(pkg.parent)), p) for p in sorted(pkg.rglob("*.py"))]
    return tuple((name, path.read_text(encoding="utf-8", errors="replace")) for name, path in found)
