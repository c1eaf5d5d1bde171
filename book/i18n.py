"""The book's own words (titles, labels, status) in English and Simplified Chinese.

Page text lives in `exercises/` and `exercises/zh/`; everything the book adds around it is here, and
computed toys label their tables with `T(english, chinese)`.
"""

from dataclasses import dataclass


@dataclass(frozen=True)
class T:
    """One text in both languages."""

    en: str
    zh: str

    def __call__(self, lang: str) -> str:
        return self.zh if lang == "zh" else self.en

    def format(self, **values) -> "T":
        return T(self.en.format(**values), self.zh.format(**values))


def text(value, lang: str) -> str:
    """A `T` in `lang`; anything else as it is (numbers, code, shapes read the same in both)."""
    return value(lang) if isinstance(value, T) else str(value)


LANGUAGE_NAMES = {"en": "English", "zh": "简体中文"}
HTML_LANG = {"en": "en", "zh": "zh-Hans"}

SECTION_TITLES = {
    "Statement": T("Statement", "题面"),
    "Where it sits": T("Where it sits", "在系统中的位置"),
    "Computation": T("Computation", "计算步骤"),
    "Intuition": T("Intuition and analogies", "直觉与类比"),
    "Shape trace": T("Shape trace", "形状追踪"),
    "Pitfalls": T("Pitfalls", "易错点"),
    "Toy": T("A toy, step by step", "逐步演算：toy 例子"),
    "Hints L1": T("Hints", "三级提示"),
    "Hints L2": T("Hints L2", "提示 L2"),
    "Hints L3": T("Hints L3", "提示 L3"),
    "Follow-ups": T("Follow-up questions", "追问"),
    "In real engines": T("In real engines", "对照真实引擎"),
}

HINT_LEVELS = {
    "Hints L1": (T("I/O example and key questions", "I/O 示例与关键问题"), T("light spoiler", "轻度剧透")),
    "Hints L2": (T("Plan and common traps", "思路拆分与常见坑"), T("medium spoiler", "中度剧透")),
    "Hints L3": (T("Answers and the shape walk", "答案与形状追踪"), T("full spoiler", "重度剧透")),
}

TRACKS = {
    "M": T("Track M · the model", "Track M · 模型"),
    "P": T("Track P · the paged engine", "Track P · 分页引擎"),
}
TRACK_BLURBS = {
    "M": T("Pure PyTorch, runs on any CPU: from RMSNorm to the whole Qwen3 model and greedy generation.",
           "纯 PyTorch，任何 CPU 都能跑：从 RMSNorm 一路搭到完整的 Qwen3 模型和贪心生成。"),
    "P": T("nano-vllm style serving pieces: a paged KV block manager and Triton kernels (interpreted on a CPU).",
           "nano-vllm 风格的 serving 组件：分页 KV 块管理器和 Triton kernel（CPU 上用解释器运行）。"),
}

DIFFICULTY = {
    "easy": T("easy", "易"),
    "medium": T("medium", "中"),
    "hard": T("hard", "难"),
}

STATUS = {
    "never": T("never checked", "还没检查过"),
    "not-started": T("not started", "未开始"),
    "partial": T("{passed} of {checks} passed", "通过 {passed}/{checks}"),
    "done": T("done", "完成"),
}

UI = {
    "book": T("KV Lab — the book", "KV Lab 练习册"),
    "book_short": T("KV Lab", "KV Lab"),
    "intro": T(
        "Rebuild Qwen3's inference path one module at a time. Each page below is one exercise: read it, "
        "write the functions in your file under mine/, and run its check command until every check passes.",
        "一次一个模块，亲手重建 Qwen3 的推理路径。下面每一页是一道练习：读题，在 mine/ 下你自己的文件里写出函数，"
        "然后运行该页的检查命令，直到全部通过。"),
    "how_status": T(
        "Statuses are your last check of each module, as ./check.sh recorded it when this book was built. "
        "Rebuild with ./check.sh book to refresh them.",
        "状态来自 ./check.sh 记录的每个模块最近一次检查结果（以构建本书时为准）。"
        "运行 ./check.sh book 重新构建即可刷新。"),
    "index": T("All modules", "全部模块"),
    "track": T("Track", "Track"),
    "minutes": T("{n} min", "{n} 分钟"),
    "difficulty": T("Difficulty", "难度"),
    "implement": T("Implement", "实现"),
    "check": T("Check", "验收"),
    "depends": T("Builds on", "前置"),
    "status": T("Your last check", "你最近一次检查"),
    "by_function": T("By function", "按函数"),
    "hint_opened": T("opened with --hint", "已用 --hint 打开"),
    "status_when": T("on {when}", "（{when}）"),
    "status_never_hint": T("run the check command to record one", "运行检查命令后这里会显示结果"),
    "progress": T("{done} of {total} modules done · {minutes_done} of {minutes} min",
                  "已完成 {done}/{total} 个模块 · {minutes_done}/{minutes} 分钟"),
    "no_modules": T("The modules of this track are being written.", "这个 Track 的模块正在编写中。"),
    "page_pending": T("page being written", "页面编写中"),
    "contents": T("On this page", "本页目录"),
    "contract": T("The contract in your file", "你的文件里的接口约定"),
    "contract_mine": T("Read from {path} when this page was built: the signature and docstring are the "
                       "whole contract; the body is yours to write.",
                       "构建本页时从 {path} 读出：签名和 docstring 就是全部约定，函数体由你来写。"),
    "contract_stub": T("Your file {path} already holds your code, so this is the contract as the untouched "
                       "stub states it (what ./check.sh reset would restore).",
                       "{path} 里已经是你写的代码，所以这里显示原始 stub 中的约定"
                       "（即 ./check.sh reset 会恢复的内容）。"),
    "contract_missing": T("The stub for this module is not available yet.", "这个模块的 stub 暂时还没有。"),
    "given": T("{name} is given complete in your file", "{name} 在你的文件里已经写好"),
    "computed": T("Computed from toy_cases/ by the reference", "由参考实现根据 toy_cases/ 计算"),
    "computed_note": T(
        "The numbers in these tables are not typed in: the book runs solutions/{stem}.py on "
        "toy_cases/{stem}.json each time it is built, the same file the checks read.",
        "下面这些表里的数字不是手写的：每次构建本书时，都会用 solutions/{stem}.py 在 toy_cases/{stem}.json "
        "上重新计算——检查读的也是同一个文件。"),
    "no_adapter": T(
        "The computed toy for this module is not available yet: the walk-through above is the page's own text.",
        "这个模块的 toy 还没有接入自动计算：上面的逐步演算是页面原文。"),
    "toy_unavailable": T("The computed toy is not available: {reason}.", "无法自动计算 toy：{reason}。"),
    "mistakes": T("What the classic mistakes look like", "经典错误长什么样"),
    "mistakes_note": T(
        "Each known mistake from the Pitfalls list, run on the same toy: the book patches the reference with "
        "the mistake (the mutant the checks are proven to reject) and shows the first run whose result "
        "differs. Wrong rows are marked.",
        "对易错点里的每个已知错误，都在同一个 toy 上运行一遍：把错误以补丁的形式打进参考实现（检查已被证明会拒绝这个"
        "mutant），展示第一个结果不同的调用。错误的行已标出。"),
    "mistake": T("mistake", "错误"),
    "run": T("run", "调用方式"),
    "under_mistake": T("with the mistake", "犯错后的结果"),
    "correct": T("correct", "正确结果"),
    "invisible": T("Invisible on the toy", "在 toy 上看不出来的错误"),
    "invisible_lead": T("The toy cannot show these; the checks catch them with {probe}. What each one does there:",
                        "下面这些错误在 toy 上显示不出来；检查会用{probe}抓住它们。每个错误在那里的表现："),
    "probe_generic": T("inputs like their own", "和检查同类的输入"),
    "seen": T("what the checks see", "检查看到的差别"),
    "invisible_nowhere": T("not visible on this page's cases either; the Pitfalls entry says which check catches it",
                           "本页的用例也显示不出来；易错点里写明了是哪项检查抓住它"),
    "mutant_unavailable": T("its mutant does not apply to the current reference ({error})",
                            "它的 mutant 补丁与当前参考实现对不上（{error}）"),
    "hint_open": T("open", "展开"),
    "back": T("All modules", "全部模块"),
    "previous": T("Previous", "上一个"),
    "next": T("Next", "下一个"),
    "other_language": T("中文", "English"),
    "pending_translation": T(
        "This page has not been translated yet.",
        "本页的中文版还在翻译中，下面先显示英文原文。"),
    "missing": T("This page is still being written. Not there yet:", "本页仍在编写中，还缺："),
    "footer": T("Built from exercises/, mine/, solutions/ and toy_cases/ by ./check.sh book.",
                "由 ./check.sh book 根据 exercises/、mine/、solutions/ 和 toy_cases/ 生成。"),
    "yes": T("yes", "是"),
    "no": T("no", "否"),
}
