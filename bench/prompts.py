"""Prompt sets shared by the benchmarks: coding requests, "edit this code" requests, prose requests."""

from __future__ import annotations

CODING = [
    "Write a Python function `merge_intervals(intervals)` that merges overlapping intervals. Include a docstring.",
    "Write a Python class `LRUCache` with `get` and `put` methods in O(1) time.",
    "Write a Python function that parses a CSV line with quoted fields and returns the list of fields.",
    "Implement binary search over a sorted list in Python, returning the index or -1.",
    "Write a Python function `word_count(text)` that returns a dict of word frequencies, ignoring case and punctuation.",
    "Write a Python generator that yields the prime numbers in increasing order.",
    "Write a function in Python that flattens an arbitrarily nested list.",
    "Write a Python function that validates an email address with a regular expression and explain it briefly.",
]

_SNIPPETS = [
    '''def compute(data):
    result = []
    for item in data:
        if item["active"]:
            total = 0
            for value in item["values"]:
                total += value
            result.append({"id": item["id"], "total": total})
    return result
''',
    '''class Account:
    def __init__(self, owner, balance=0):
        self.owner = owner
        self.balance = balance

    def deposit(self, amount):
        if amount <= 0:
            raise ValueError("amount must be positive")
        self.balance += amount
        return self.balance

    def withdraw(self, amount):
        if amount > self.balance:
            raise ValueError("insufficient funds")
        self.balance -= amount
        return self.balance
''',
    '''def read_config(path):
    config = {}
    with open(path) as f:
        for line in f:
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            key, value = line.split("=", 1)
            config[key.strip()] = value.strip()
    return config
''',
    '''def fetch_all(urls, session):
    pages = []
    for url in urls:
        response = session.get(url, timeout=10)
        if response.status_code == 200:
            pages.append(response.text)
        else:
            print("failed", url, response.status_code)
    return pages
''',
]

_EDITS = [
    "Add type hints to this function and change nothing else. Reply with the full code only.",
    "Rename the variable `result` to `summaries` (and `balance` to `funds` if present). Reply with the full code only.",
    "Add a one-line docstring to every function. Reply with the full code only.",
    "Replace print calls with logging (add `import logging` at the top). Reply with the full code only.",
]

# Eight distinct (instruction, snippet) pairs, each instruction one that applies to its snippet; the
# snippet is the request's reference. (Until session 76 the set held the first four pairs twice, so
# an "8-prompt" edit run measured four answers, each decoded twice.)
_EDIT_PAIRS = [(0, 0), (1, 1), (2, 2), (3, 3), (1, 0), (2, 1), (0, 2), (2, 3)]
EDIT = [(f"{_EDITS[e]}\n\n```python\n{_SNIPPETS[s]}```", _SNIPPETS[s]) for e, s in _EDIT_PAIRS]

# Prose asks, none of them among the subjects or wordings `specserve train-draft` generates its
# conversations from (held out for drafter heads trained here).
PROSE = [
    "Tell me about the history of the bicycle in a few paragraphs.",
    "Why do leaves change colour in autumn? Explain it simply.",
    "Write a friendly note inviting my neighbours to a street picnic on Saturday.",
    "Summarise the plot of a heist movie you invent, in about 150 words.",
    "What should a beginner know before adopting a rabbit?",
    "Describe a quiet morning in a fishing village.",
    "Give advice to someone preparing for their first job interview.",
    "Compare tea and hot chocolate as winter drinks.",
]

# Coding and explanation asks in Chinese: a third of Qwen2.5's tokens in Chinese answers lie above
# the 65,536 ids a draft head keeps by default (BPE merge order puts English and code first).
CHINESE = [
    "请写一个Python函数，计算列表中所有偶数的和，并解释它的时间复杂度。",
    "用中文解释什么是二分查找，并给出一个Python实现。",
    "请用中文介绍一下快速排序算法的原理和步骤。",
    "写一个Python类来表示银行账户，支持存款和取款，并用中文注释。",
    "用中文解释Python中列表和元组的区别。",
    "请写一段Python代码读取CSV文件并计算每一列的平均值，用中文说明每一步。",
    "什么是递归？请用中文举一个计算阶乘的例子。",
    "请用中文解释HTTP协议中GET和POST请求的区别。",
]
