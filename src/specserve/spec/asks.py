"""What `specserve train-draft` asks the target, so that a head learns the text the target writes.

A head trained on a few hundred asks memorises their answers (greedy answers to one ask are one
text) and drafts new asks' answers poorly: SmolLM2's head agreed with its target on 0.59 of
held-out answers to the training asks but on 0.26 of answers to new ones. So the asks are drawn
from a few thousand combinations of subjects, wordings and styles, and everyday programming tasks
join the questions about the corpus's own functions.

None of bench/prompts.py's subjects or wordings is here: its asks stay held out for heads trained
here. `held_out` splits every list so that held-out conversations share neither subject nor
wording with the training ones.
"""

from __future__ import annotations

import ast
import random
from pathlib import Path

# Everyday subjects, grouped only to keep the list readable.
TOPICS = (
    # nature and places
    "the sea", "a lighthouse", "rain in a city", "mountains in winter", "volcanoes", "deserts", "the ocean floor",
    "a thunderstorm", "the water cycle", "rivers", "coral reefs", "glaciers", "a rainforest", "caves", "islands",
    "the northern lights", "earthquakes", "tides", "a meadow in spring", "sand dunes", "waterfalls", "wetlands",
    "a city park", "a night sky full of stars", "fog", "a hot summer day", "snowflakes", "the Sahara",
    "the Amazon river", "the Alps", "a small mountain town", "an old harbour", "a busy train station",
    "a night market", "a public library", "an airport at dawn", "a farm", "a vineyard", "a lake cabin",
    # animals and plants
    "bees", "penguins", "dinosaurs", "a cat and a dog", "owls", "elephants", "octopuses", "ants", "wolves",
    "dolphins", "butterflies", "horses", "parrots", "sharks", "tortoises", "frogs", "whales", "foxes",
    "honeybees and flowers", "oak trees", "sunflowers", "mushrooms", "cacti", "bamboo", "a vegetable garden",
    "migrating birds", "squirrels", "jellyfish", "a beehive", "spiders",
    # science and technology
    "photosynthesis", "the solar system", "the human heart", "sleep", "the internet", "electric cars",
    "black holes", "gravity", "DNA", "vaccines", "solar panels", "wind turbines", "batteries", "magnets",
    "the immune system", "the brain", "microscopes", "telescopes", "satellites", "3D printing", "robots",
    "artificial intelligence", "smartphones", "GPS", "electricity", "rainbows", "sound waves", "the moon",
    "Mars", "comets", "plate tectonics", "antibiotics", "clouds", "lightning", "nuclear energy", "the periodic table",
    "climate and weather", "recycling", "plastic pollution", "clean water", "bacteria", "the speed of light",
    "computers", "cryptography", "email", "video calls", "search engines", "spreadsheets", "open source software",
    # history and culture
    "the moon landing", "the history of Rome", "the Renaissance", "the printing press", "ancient Egypt",
    "the Vikings", "the Silk Road", "the Industrial Revolution", "castles", "the Olympic Games",
    "the invention of the telephone", "the Great Wall of China", "pirates", "knights", "samurai",
    "ancient Greek theatre", "the first airplanes", "steam trains", "lighthouses of the past", "old maps",
    "museums", "libraries through the ages", "the history of money", "writing systems", "calendars",
    "folk music", "jazz", "classical music", "painting with watercolours", "photography", "poetry",
    "comic books", "board games", "chess", "video games", "theatre", "dance", "street art", "architecture",
    "fashion", "festivals around the world", "fairy tales", "mythology", "languages", "sign language",
    # daily life
    "coffee", "a small bakery", "friendship", "a train journey", "learning a language", "gardening",
    "a lost key", "a first day at school", "a birthday party", "a detective", "time management",
    "a market in Morocco", "bridges", "healthy breakfast", "the stock market", "a haunted house",
    "a letter to a friend", "kindness", "cooking pasta", "baking bread", "running a marathon", "yoga",
    "camping", "moving to a new city", "saving money", "a rainy weekend", "public transport", "cycling to work",
    "a road trip", "a picnic in the mountains", "learning to swim", "playing the piano", "a science fair",
    "a school play", "volunteering", "grandparents", "siblings", "a wedding", "a new puppy", "houseplants",
    "a cosy reading corner", "a power cut", "a snow day", "working from home", "a long flight", "a family dinner",
    "a football match", "a farmers' market", "making pizza at home", "a hiking trip", "a spelling bee",
    "a school library", "a robot learning to paint", "a talking tree", "a dragon who is afraid of the dark",
    "a time traveller", "a secret garden", "a clock that runs backwards", "a mysterious letter",
    "an astronaut's first day in space", "a lighthouse keeper", "a shy giant", "a map to hidden treasure",
    "a magical bookshop", "a city under the sea", "a robot chef", "a lost umbrella", "a broken elevator",
    # work and ideas
    "teamwork", "leadership", "public speaking", "writing a resume", "negotiation", "starting a small business",
    "customer service", "remote teams", "meetings", "deadlines", "feedback", "creativity", "curiosity",
    "patience", "honesty", "habits", "motivation", "stress", "mindfulness", "goal setting", "note taking",
    "studying for exams", "reading more books", "learning to code", "mentoring", "budgeting",
    "renting an apartment", "buying a used car", "planning a vacation", "packing light", "first aid",
    "staying hydrated", "walking every day", "eating vegetables", "screen time", "social media",
    "online privacy", "strong passwords", "digital photos", "podcasts", "newspapers", "advertising",
    "electric scooters", "city planning", "renewable energy", "food waste", "fair trade", "democracy", "voting",
)

PROSE_ASKS = (
    "Write a short story about {t}.", "Explain {t} to a ten-year-old.", "Write three facts about {t}.",
    "Write a short poem about {t}.", "Write an email to a colleague about {t}.",
    "What are the pros and cons of {t}?", "Describe {t} in one paragraph.", "Give me a list of tips about {t}.",
    "Tell me something interesting about {t}.", "Why do people care about {t}?",
    "Write the opening of a blog post about {t}.", "Write a diary entry from someone who loves {t}.",
    "How does {t} work? Explain step by step.", "Write a product description inspired by {t}.",
    "Give me five questions a student might ask about {t}, with answers.",
    "Write a dialogue between two friends talking about {t}.", "What do most people get wrong about {t}?",
    "Write a short speech for a school assembly about {t}.", "Describe {t} to someone who has never seen it.",
    "Write a short news report about {t}.", "What are some common myths about {t}?",
    "Write a persuasive paragraph on why {t} matters.", "Write a thank-you note that mentions {t}.",
    "Explain the science behind {t}.", "Write a short review of an imaginary book about {t}.",
    "What are the main ideas behind {t}?", "Create a short quiz about {t}.",
    "Write a bedtime story involving {t}.", "List ten words that come to mind for {t} and explain two of them.",
    "Write a haiku and a limerick about {t}.", "Write a travel guide entry about {t}.",
    "What can we learn from {t}?",
)

STYLES = ("", "", "", " Keep it under 100 words.", " Use simple words.", " Use bullet points.",
          " Make it funny.", " Write it in a formal tone.", " Answer in two paragraphs.")

# Everyday programming tasks (the questions about the corpus's functions come from the files).
TASKS = (
    "checks whether a string is a palindrome", "returns the n-th Fibonacci number", "reverses a linked list",
    "sorts a list with quicksort", "sorts a list with merge sort", "counts the vowels in a string",
    "removes duplicates from a list while keeping the order", "finds the largest element in a list",
    "computes the factorial of a number", "checks whether two strings are anagrams",
    "converts a temperature from Celsius to Fahrenheit", "finds the greatest common divisor of two numbers",
    "transposes a matrix given as a list of lists", "rotates a list by k positions",
    "finds the second largest number in a list", "capitalizes the first letter of every word",
    "checks whether parentheses in a string are balanced", "converts a Roman numeral to an integer",
    "converts an integer to a Roman numeral", "returns all permutations of a string",
    "computes the sum of the digits of a number", "finds the longest common prefix of a list of strings",
    "groups a list of words by their first letter", "chunks a list into pieces of size n",
    "reads a text file and returns its lines without trailing whitespace", "writes a dict to a JSON file",
    "counts how many times each character appears in a string", "returns the indices of two numbers that add up to a target",
    "implements a stack class with push, pop and peek", "implements a queue with two stacks",
    "computes a running average of a stream of numbers", "finds the missing number in a list from 1 to n",
    "checks whether a number is a power of two", "converts a string to snake_case",
    "converts a string to camelCase", "merges two sorted lists into one sorted list",
    "computes the Levenshtein distance between two strings", "finds all files with a given extension in a directory",
    "parses a date string in the format YYYY-MM-DD", "returns the median of a list of numbers",
    "implements a simple to-do list class", "counts the lines, words and characters of a file",
    "checks whether a year is a leap year", "generates a random password of a given length",
    "finds the most common element in a list", "computes the dot product of two vectors",
    "implements depth-first search on a graph given as a dict", "implements breadth-first search on a grid",
    "finds the shortest path in a weighted graph with Dijkstra's algorithm", "serializes a binary tree to a list",
    "computes the height of a binary tree", "implements a min-heap class", "checks whether a sudoku row is valid",
    "truncates a string to a maximum length with an ellipsis", "converts bytes to a human-readable size",
    "retries a function call up to three times", "times how long a function takes with a decorator",
    "caches the results of a function with a dictionary", "validates a phone number",
    "splits a full name into first and last name", "formats a number with thousands separators",
    "computes compound interest", "converts a list of tuples into a dictionary",
    "finds the intersection of two lists", "zips two lists into a list of pairs without zip",
)

CODE_ASKS = (
    "Write a Python function `{name}({args})` that does this: {doc}",
    "Explain what this Python code does:\n\n```python\n{src}\n```",
    "Write a docstring and comments for this code:\n\n```python\n{src}\n```",
    "How would I {doc_lower} in Python? Show an example.",
    "Rewrite this function to be clearer:\n\n```python\n{src}\n```",
)

CODE_STYLES = ("", "", "", " Keep it short.", " Add comments.", " Handle edge cases.",
               " Explain the time complexity.", " Use only the standard library.")

TASK_ASKS = (
    "Write a Python function that {task}.", "Write a Python function that {task}. Include a docstring.",
    "Show me how to write a function that {task}, with an example call.",
    "Write a Python function that {task} and explain how it works.",
    "Implement a function that {task}. Add type hints.",
    "Write a short Python program that {task}.", "Write a Python function that {task}, with a few tests.",
    "I need a helper that {task}. Can you write it in Python?",
)


def held_out(items: tuple[str, ...], held: bool) -> tuple[str, ...]:
    """Every fourth of `items` (held) or the others: held-out conversations ask about subjects, in
    wordings, that no training conversation uses (greedy answers to the same ask are the same text,
    so a shared ask would put training text in the held-out set)."""
    return tuple(x for i, x in enumerate(items) if (i % 4 == 3) == held)


def _corpus_functions(files: list[Path], rng: random.Random) -> list[tuple[str, str, str, str]]:
    """(name, args, first docstring line, source) of documented functions in up to 400 files."""
    funcs = []
    for path in rng.sample(files, min(len(files), 400)):
        try:
            text = path.read_text(encoding="utf-8")
            tree = ast.parse(text)
        except (SyntaxError, UnicodeDecodeError, OSError, ValueError, RecursionError):
            continue
        lines = text.splitlines()
        for node in ast.walk(tree):
            if not isinstance(node, ast.FunctionDef) or not node.end_lineno:
                continue
            first = (ast.get_docstring(node) or "").strip().splitlines()[:1]
            if not first:  # no docstring, or one of blanks
                continue
            doc = first[0].rstrip(".")
            src = "\n".join(lines[node.lineno - 1 : min(node.end_lineno, node.lineno + 30)])
            if 10 < len(doc) < 120 and len(src) < 1500:
                funcs.append((node.name, ", ".join(a.arg for a in node.args.args), doc, src))
    return funcs


def chat_prompts(files: list[Path], n: int, seed: int, held: bool = False) -> list[str]:
    """n distinct user messages in a seeded order: half prose asks (a subject in a wording and a
    style), a quarter programming tasks, a quarter about the corpus's own functions; the held-out
    or the training share of every list."""
    rng = random.Random(seed)
    funcs = _corpus_functions(files, rng)
    topics, asks, tasks, task_asks = (held_out(x, held) for x in (TOPICS, PROSE_ASKS, TASKS, TASK_ASKS))
    out: list[str] = []
    seen: set[str] = set()
    tries = 0
    while len(out) < n and tries < 20 * n:
        kind = tries % 4  # (by tries, not by asks kept: a corpus with few functions has few distinct ones)
        tries += 1
        if kind == 3 and funcs:
            name, args, doc, src = rng.choice(funcs)
            ask = rng.choice(CODE_ASKS).format(name=name, args=args, doc=doc, doc_lower=doc[0].lower() + doc[1:],
                                               src=src)
        elif kind == 1:
            ask = rng.choice(task_asks).format(task=rng.choice(tasks)) + rng.choice(CODE_STYLES)
        else:
            ask = rng.choice(asks).format(t=rng.choice(topics)) + rng.choice(STYLES)
        if ask not in seen:
            seen.add(ask)
            out.append(ask)
    return out
