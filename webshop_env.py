"""WebShop in one file: catalogue, goals, search engine, text pages and reward.

WebShop (Yao et al., 2022, princeton-nlp/WebShop) is one of the two benchmarks of
RetireOPD. The original runs a Flask site, a Java/Lucene search engine (pyserini),
spaCy and BeautifulSoup, and downloads its data from Google Drive. This module
replaces all of that with the standard library and gives the same observations,
search results and rewards as the original's text environment
(``WebAgentTextEnv(observation_mode='text')``):

* catalogue  -- the original's ``load_products`` on the official files
                (``items_shuffle_1000.json``, ``items_ins_v2_1000.json``, optional
                ``items_human_ins.json``), or a small built-in catalogue written for
                this project, so that the demo and the tests need no download;
* goals      -- the original's synthetic goals (one per instruction x option
                combination) with the same random draws, or its human goals; then a
                fixed split: one shuffle with seed 233, the first 500 goals are the
                validation panel (a quarter of the goals for small catalogues);
* search     -- Lucene's BM25 as Anserini runs it (k1=0.9, b=0.4, one-byte length
                norms, float32 arithmetic), over the same indexed text, with a
                re-implementation of Lucene's analyzer (UAX#29 word breaking,
                possessive filter, lower case, 33 stop words, Porter stemming);
* pages      -- the text the original's BeautifulSoup conversion produces for each
                HTML page, segment by segment, and the same clickables;
* reward     -- the original's ``get_reward``: attribute, option, price and type
                terms, with thefuzz 0.19.0's ``token_set_ratio`` rebuilt on difflib.

Quirks of the original that are kept on purpose (each is marked "quirk" below):
goal options are compared as (name, value) tuples (``goal_options.items()``) in the
default ``faithful`` reward mode; a missing price is shown and charged as $100.0;
selected options are never shown on the item page; ``Next >`` is offered on every
results page, even past the last one; ``search[...]`` works on every page, also after
the purchase, and only the purchase step says ``done``; ``< Prev`` on an item page
forgets the chosen options; the page kind is read from a URL that contains the query;
refused actions (malformed, unknown or absent buttons, ``click[search]``) leave the
page as it is and earn 0. The golden files in ``shared/webshop`` check all of this.

Where this module deviates:
* The type term needs spaCy's noun tags of product titles. They are read from
  ``title_nouns.json`` in the data folder (exact). For titles not in it (always on
  the built-in catalogue) a documented heuristic is used (``heuristic_title_nouns``)
  and the step info says ``reward_approximate=True``.
* Refused actions return 0.0 and ``info["valid"] = False`` (the original: an int 0).
  The admissible-action list leaves out ``click[search]``, which is always refused.
* Random draws use private ``random.Random`` instances (same numbers as the
  original's ``random.seed(...)`` calls, without touching the global generator).
* ``search[<r> ...]`` draws from the environment's own generator, and
  ``search[<a> attribute]`` filters by attribute, which the original's text
  environment intended but crashed on; ``search[<c>]`` without a category gives no
  results instead of crashing.
* The tokenizer knows the Unicode classes that occur in product text (Latin and other
  alphabets, digits, CJK, kana, South-East Asian scripts, emoji); exotic rules of
  UAX#29 (Hebrew quotes, keycap sequences, tokens longer than 255 characters) are not
  reproduced.
* Reviews and ratings are empty and ``N.A.``, as in the original's current code,
  which no longer reads a reviews file.

Run ``python webshop_env.py --benchmark [DATA_DIR]`` for load, search and step timings.
"""
from __future__ import annotations

import array
import difflib
import itertools
import json
import math
import os
import random
import re
import struct
import sys
import time
import unicodedata
from collections import Counter, defaultdict
from decimal import Decimal
from pathlib import Path

# =============================================================================
# Catalogue
# =============================================================================

PRODUCTS_FILE = "items_shuffle_1000.json"
ATTRIBUTES_FILE = "items_ins_v2_1000.json"
HUMAN_INSTRUCTIONS_FILE = "items_human_ins.json"
TITLE_NOUNS_FILE = "title_nouns.json"

DATA_HELP = (
    f"A WebShop data folder holds {PRODUCTS_FILE} and {ATTRIBUTES_FILE} "
    f"(optional: {HUMAN_INSTRUCTIONS_FILE}, {TITLE_NOUNS_FILE}). Get them with the "
    "setup script of princeton-nlp/WebShop (`./setup.sh -d small`), which downloads "
    "them from the original project's Google Drive links, then pass the folder "
    "(retireopd.py --webshop-data DIR, or WebShop(data_dir=DIR)) or set WEBSHOP_DATA. "
    "Without a folder the built-in catalogue is used."
)

# WebShop's five product categories, mapped to the skill blocks of the training
# script (the data calls furniture/home "garden" and food "grocery").
SKILL_CATEGORY = {"beauty": "beauty", "grocery": "food", "fashion": "fashion",
                  "garden": "furniture", "electronics": "electronics"}

# The skills of WebShop: short strategy notes per skill block, written by us (the privileged information
# of self-OPD). Only the teacher sees them: in phase 1 while it trains, in phase 2 when it scores the
# student's tokens (retireopd.py, skill_text).
WEBSHOP_SKILLS = {
    "general": [
        "Search with the product type and its two or three most specific attributes; leave out the "
        "price, quantity words and filler.",
        "On the results page, open the item whose title matches the product type and most attributes "
        "and whose price is below the budget; use next > only if none fits.",
        "On the item page, click every option the instruction names (size, colour, flavour, count), "
        "choosing the value that matches exactly; options are not shown as selected, so click each once.",
        "Check the price against the budget, then click buy now. Do not buy a different product type.",
    ],
    "beauty": ["Match scent, size in ounces and 'paraben free'/'natural' style claims in the title."],
    "food": ["Match flavour, pack count and dietary words (gluten free, sugar free, keto) exactly."],
    "fashion": ["Match the exact size label (large vs x-large, 8 vs 8 wide) and the colour name."],
    "furniture": ["Match the material, colour and dimensions; a 'set of 2' must say so in the title."],
    "electronics": ["Match the device it is for, the capacity and the connector type in the title."],
}

# The built-in catalogue. One row per product:
# (asin, category, query, product_category, title, pricing text, description,
#  bullet points, options {name: [values] or None}, attributes,
#  instruction or None, instruction attributes).
# It contains the traps the reward is known for: "standard" contains the colour
# "tan", "navy blue" normalises to "blue", "large" is a token subset of "x-large",
# and "8" vs "8 wide"; a price range, a missing price, a price above $990 (no
# price text), a null option group, values with "/" and a bullet-point string.
_BUILTIN_ROWS = [
    ("B0BTY00001", "beauty", "facial moisturizers",
     "Beauty & Personal Care › Skin Care › Face › Creams & Moisturizers › Face Moisturizers",
     "Lavender Dew Hydrating Face Moisturizer with Hyaluronic Acid, 1.7 Fl Oz", "$18.99",
     "A light daily cream with hyaluronic acid that keeps dry skin soft all day.",
     ["Fragrance free formula for sensitive and dry skin", "Absorbs in seconds"],
     {"Size": ["1.7 Fl Oz", "3.4 Fl Oz"], "Scent": None},
     ["hyaluronic acid", "fragrance free", "dry skin"],
     "i need a hyaluronic acid face moisturizer for dry skin", ["hyaluronic acid", "dry skin"]),
    ("B0BTY00002", "beauty", "lipstick",
     "Beauty & Personal Care › Makeup › Lips › Lipstick",
     "Velvet Matte Long Lasting Liquid Lipstick", "$9.99$14.99",
     "Highly pigmented liquid lipstick with a velvet matte finish.",
     ["Long lasting wear up to 12 hours", "Cruelty free and vegan"],
     {"Color": ["Ruby Red", "Nude/Pink", "Standard"]},
     ["long lasting", "cruelty free"],
     "find me a long lasting cruelty free lipstick", ["long lasting", "cruelty free"]),
    ("B0BTY00003", "beauty", "facial moisturizers",
     "Beauty & Personal Care › Skin Care › Face › Sunscreens",
     "Daily Oil Free Face Lotion SPF 30", "$12.50",
     "Oil free daily face lotion with broad spectrum SPF 30.", "",
     {}, ["oil free"], None, []),
    ("B0FOD00001", "grocery", "coffee beans",
     "Grocery & Gourmet Food › Beverages › Coffee, Tea & Cocoa › Coffee › Whole Coffee Beans",
     "Organic Dark Roast Whole Bean Coffee, 12 Ounce (Pack of 2)", "$24.99",
     "Small batch organic coffee beans, roasted in Colombia.",
     ["USDA organic and fair trade certified", "Rich chocolate notes"],
     {"Size": ["12 Ounce (Pack of 2)", "2 Pound"], "Flavor Name": ["Dark Roast", "Medium Roast"]},
     ["usda organic", "fair trade"],
     "i want organic fair trade whole bean coffee", ["usda organic", "fair trade"]),
    ("B0FOD00002", "grocery", "potato chips",
     "Grocery & Gourmet Food › Snacks & Sweets › Chips & Crisps › Potato Chips",
     "Kettle Cooked Potato Chips, Variety Pack of 24", "",
     "Thick cut kettle chips cooked in small batches.",
     ["Gluten free and non GMO", "24 single serve bags"],
     {"Flavor": ["Sea Salt", "Salt & Vinegar"]},
     ["gluten free", "non gmo"],
     "find me gluten free non gmo potato chips", ["gluten free", "non gmo"]),
    ("B0FSH00001", "fashion", "men's t-shirts",
     "Clothing, Shoes & Jewelry › Men › Clothing › Shirts › T-Shirts",
     "Men's Classic Fit Crewneck Cotton T-Shirt", "$12.99$19.99",
     "Soft cotton crewneck tee for everyday wear.",
     ["Machine wash cold", "Classic fit through the chest"],
     {"Color": ["Navy Blue", "Blue", "Heather Grey"], "Size": ["Large", "X-Large", "XX-Large"]},
     ["machine wash", "classic fit", "cotton"],
     "i need a classic fit machine wash t-shirt for men", ["classic fit", "machine wash"]),
    ("B0FSH00002", "fashion", "women's running shoes",
     "Clothing, Shoes & Jewelry › Women › Shoes › Athletic › Running › Road Running",
     "Women's Lightweight Running Shoes Breathable Mesh Sneakers", "$45.00",
     "Breathable mesh running shoes with a cushioned sole.",
     ["Rubber sole", "Lightweight mesh upper"],
     {"Size": ["8", "8 Wide", "9"], "Color": ["Black/White", "Pink"]},
     ["rubber sole", "lightweight"],
     "find me lightweight women's running shoes with rubber sole", ["lightweight", "rubber sole"]),
    ("B0FSH00003", "fashion", "women's running shoes",
     "Clothing, Shoes & Jewelry › Women › Shoes › Athletic › Running › Trail Running",
     "Women's Waterproof Trail Running Shoes", "$59.99",
     "Waterproof trail shoes with a grippy rubber sole.",
     ["Waterproof membrane", "Rubber sole"],
     {"Size": ["8", "9"]}, ["waterproof", "rubber sole"], None, []),
    ("B0HOM00001", "garden", "accent chairs",
     "Home & Kitchen › Furniture › Living Room Furniture › Chairs › Accent Chairs",
     "Mid Century Modern Accent Chair with Solid Wood Legs, Living Room Armchair", "$159.99",
     "Upholstered armchair on solid wood legs; assembles in ten minutes.",
     ["Easy assemble, tools included", "Solid wood legs"],
     {"Color": ["Navy Blue", "Grey"]},
     ["solid wood", "living room", "easy assemble"],
     "find me an easy assemble accent chair with solid wood legs for living room",
     ["easy assemble", "solid wood", "living room"]),
    ("B0HOM00002", "garden", "console tables",
     "Home & Kitchen › Furniture › Living Room Furniture › Tables › Sofa & Console Tables",
     "Rustic Reclaimed Wood Console Table for Entryway", "$1,249.00",
     "Hand made console table from reclaimed pine.",
     "Solid reclaimed wood, 54 inches wide",
     {}, ["solid wood"], "i want a solid wood console table", ["solid wood"]),
    ("B0ELC00001", "electronics", "over-ear headphones",
     "Electronics › Headphones, Earbuds & Accessories › Headphones & Earbuds › Over-Ear Headphones",
     "Wireless Bluetooth Over Ear Headphones with Active Noise Cancelling", "$59.99",
     "Over ear headphones with 40 hours of battery and active noise cancelling.",
     ["Long battery life: 40 hours", "Noise cancelling for travel"],
     {"Color": ["Black", "Silver"]},
     ["noise cancelling", "long battery life"],
     "i need noise cancelling wireless headphones with long battery life",
     ["noise cancelling", "long battery life"]),
    ("B0ELC00002", "electronics", "hdmi cables",
     "Electronics › Television & Video › Accessories › Cables › HDMI Cables",
     "4K HDMI Cable 6ft, High Speed 18Gbps Braided Cord", "$7.99",
     "High speed HDMI 2.0 cable with gold plated connectors.",
     ["High speed 18Gbps", "Gold plated connectors"],
     {"Size": ["3ft", "6ft", "10ft"], "Style": None},
     ["high speed", "gold plated"],
     "find me a high speed hdmi cable", ["high speed"]),
]


def builtin_catalogue():
    """The built-in catalogue as (raw products, attribute file) in the official schema."""
    raw_products, attributes = [], {}
    for (asin, category, query, product_category, title, pricing, description, bullets,
         options, attrs, instruction, instruction_attrs) in _BUILTIN_ROWS:
        raw_products.append({
            "name": title, "full_description": description, "pricing": pricing,
            "images": [f"https://example.invalid/{asin}.jpg"],
            "product_category": product_category, "average_rating": "",
            "small_description": bullets,
            "customization_options": {
                name: None if values is None else [{"value": v, "image": None} for v in values]
                for name, values in options.items()} or "",
            "asin": asin, "category": category, "query": query, "page": 1,
        })
        attributes[asin] = {"attributes": attrs}
        if instruction is not None:
            attributes[asin].update(instruction=instruction,
                                    instruction_attributes=instruction_attrs)
    return raw_products, attributes


def parse_pricing(pricing_text):
    """Price list and price tag as the original: "$1,847.00$2.5" -> [1847.0, 2.5]."""
    if not pricing_text:
        return [100.0], "$100.0"    # quirk: a missing price is shown as $100.0
    try:
        prices = [float(Decimal(re.sub(r"[^\d.]", "", part))) for part in pricing_text.split("$")[1:]]
    except ArithmeticError:  # (decimal.InvalidOperation: "$N/A")
        raise ValueError(f"a product's pricing {pricing_text[:60]!r} holds a price that is not a number") from None
    if len(prices) == 1:
        return prices, f"${prices[0]}"
    return prices[:2], f"${prices[0]} to ${prices[1]}"


def parse_options(customization_options):
    """{name: [value, ...]} with lower case and "/" -> " | ", null groups skipped."""
    options, option_to_image = {}, {}
    for name, contents in (customization_options or {}).items():
        if contents is None:
            continue
        values = []
        for content in contents:
            value = content["value"].strip().replace("/", " | ").lower()
            values.append(value)
            option_to_image[value] = content.get("image")
        options[name.lower()] = values
    return options, option_to_image


def process_products(raw_products, attributes, human_instructions=None):
    """The original's ``load_products``: one processed dict per distinct valid ASIN.

    With ``human_instructions`` (human goals) products carry ``instructions``;
    otherwise the synthetic ``instruction_text``/``instruction_attributes``.
    """
    products, seen = [], set()
    for raw in raw_products:
        asin = raw["asin"]
        if asin == "nan" or len(asin) > 10 or asin in seen:
            continue
        seen.add(asin)
        product = dict(raw)
        try:
            pricing, price_tag = parse_pricing(raw.get("pricing"))
        except ValueError as error:  # (which product, in a catalogue of thousands)
            raise ValueError(f"product {asin}: {error}") from None
        options, option_to_image = parse_options(raw["customization_options"])
        bullets = raw["small_description"]
        info = attributes.get(asin, {})
        product.update(
            Title=raw["name"], Description=raw["full_description"], Reviews=[],
            Rating="N.A.", BulletPoints=bullets if isinstance(bullets, list) else [bullets],
            pricing=pricing, Price=price_tag, options=options,
            option_to_image=option_to_image,
            Attributes=info["attributes"] if "attributes" in info else ["DUMMY_ATTR"],
            MainImage=(raw.get("images") or [None])[0],
            query=raw["query"].lower().strip())
        if human_instructions is not None:
            if asin in human_instructions:
                product["instructions"] = human_instructions[asin]
        else:
            product["instruction_text"] = info.get("instruction")
            product["instruction_attributes"] = info.get("instruction_attributes")
        products.append(product)
    return products


def draw_product_prices(products, rng):
    """{asin: price}; a price range draws uniform(lo, hi), in catalogue order."""
    return {p["asin"]: p["pricing"][0] if len(p["pricing"]) == 1 else rng.uniform(*p["pricing"][:2])
            for p in products}


def _read_json(path):
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError) as error:
        raise ValueError(f"Cannot read {path}: {error}. {DATA_HELP}") from error


def load_data_folder(data_dir, human_goals=False):
    """(raw products, attributes, human instructions or None, title nouns or None)."""
    folder = Path(data_dir)
    missing = [name for name in (PRODUCTS_FILE, ATTRIBUTES_FILE)
               + ((HUMAN_INSTRUCTIONS_FILE,) if human_goals else ())
               if not (folder / name).is_file()]
    if missing:
        raise FileNotFoundError(
            f"WebShop data folder {folder} lacks {', '.join(missing)}. {DATA_HELP}")
    raw_products = _read_json(folder / PRODUCTS_FILE)
    attributes = _read_json(folder / ATTRIBUTES_FILE)
    well_formed = (isinstance(raw_products, list) and isinstance(attributes, dict)
                   and all(isinstance(p, dict) and "asin" in p for p in raw_products))
    if not well_formed:
        raise ValueError(f"Malformed WebShop data in {folder}: expected a list of products "
                         f"and an attribute dict. {DATA_HELP}")
    human = _read_json(folder / HUMAN_INSTRUCTIONS_FILE) if human_goals else None
    nouns_path = folder / TITLE_NOUNS_FILE
    title_nouns = _read_json(nouns_path) if nouns_path.is_file() else None
    return raw_products, attributes, human, title_nouns


# =============================================================================
# Goals
# =============================================================================

PRICE_STEPS = [10.0 * i for i in range(1, 100)]
SPLIT_SEED = 233
VALID_PANEL_SIZE = 500


def draw_price_upper(price, rng):
    """Two of the next four $10 steps above the price; the larger is the budget."""
    candidates = [p for p in PRICE_STEPS if p > price][:4]
    if len(candidates) < 2:
        return 1000000, ""
    _, price_upper = sorted(rng.sample(candidates, 2))
    return price_upper, f", and price lower than {price_upper:.2f} dollars"


def synthetic_goals(products, prices, rng):
    """The original's ``get_synthetic_goals``: one goal per option combination."""
    goals = []
    for product in products:
        if product.get("instruction_text") is None:
            continue
        price_upper, price_text = draw_price_upper(prices[product["asin"]], rng)
        names = sorted(product["options"])
        for combination in itertools.product(*(product["options"][n] for n in names)):
            goal_options = dict(zip(names, combination))
            option_text = ", and ".join(f"{k}: {v}" for k, v in goal_options.items())
            option_text = " with " + option_text if option_text else ""
            goals.append(_goal(product, f"{product['instruction_text']}{option_text}{price_text}",
                               product["instruction_attributes"], price_upper, goal_options))
    return goals


def human_goals_from(products, prices, rng):
    """The original's ``get_human_goals``: one goal per human instruction."""
    goals = []
    for product in products:
        for instruction in product.get("instructions", []):
            if not instruction["instruction_attributes"]:
                continue
            price_upper, price_text = draw_price_upper(prices[product["asin"]], rng)
            goals.append(_goal(product, instruction["instruction"].strip(".") + price_text,
                               instruction["instruction_attributes"], price_upper,
                               instruction["instruction_options"]))
    return goals


def _goal(product, instruction_text, attributes, price_upper, goal_options):
    return {"asin": product["asin"], "category": product["category"], "query": product["query"],
            "name": product["Title"], "product_category": product["product_category"],
            "instruction_text": instruction_text, "attributes": attributes,
            "price_upper": price_upper, "goal_options": goal_options}


def split_goals(n_goals, seed=SPLIT_SEED):
    """(validation, train) goal indices from one shuffle, like the original's env.

    The first 500 shuffled goals (a quarter of them on small catalogues) are the
    fixed validation panel; the rest are for training.
    """
    order = list(range(n_goals))
    random.Random(seed).shuffle(order)
    n_valid = min(VALID_PANEL_SIZE, n_goals // 4)
    return order[:n_valid], order[n_valid:]


# =============================================================================
# Search: Lucene's analyzer and BM25, as Anserini runs them
# =============================================================================
# Anserini's DefaultEnglishAnalyzer: StandardTokenizer (UAX#29 word breaks) ->
# EnglishPossessiveFilter -> LowerCaseFilter -> StopFilter -> PorterStemFilter.
# The tokenizer works on a string of one-letter character classes; a regular
# expression written after Lucene's JFlex grammar then finds the tokens.

STOP_WORDS = frozenset(
    "a an and are as at be but by for if in into is it no not of on or such that the "
    "their then there these they this to was will with".split())

# Extended_Pictographic (Unicode emoji data): each such character is a token.
_PICTOGRAPHIC = (
    (0x00A9, 0x00A9), (0x00AE, 0x00AE), (0x203C, 0x203C), (0x2049, 0x2049),
    (0x2122, 0x2122), (0x2139, 0x2139), (0x2194, 0x2199), (0x21A9, 0x21AA),
    (0x231A, 0x231B), (0x2328, 0x2328), (0x2388, 0x2388), (0x23CF, 0x23CF),
    (0x23E9, 0x23F3), (0x23F8, 0x23FA), (0x24C2, 0x24C2), (0x25AA, 0x25AB),
    (0x25B6, 0x25B6), (0x25C0, 0x25C0), (0x25FB, 0x25FE), (0x2600, 0x2605),
    (0x2607, 0x2612), (0x2614, 0x2685), (0x2690, 0x2705), (0x2708, 0x2712),
    (0x2714, 0x2714), (0x2716, 0x2716), (0x271D, 0x271D), (0x2721, 0x2721),
    (0x2728, 0x2728), (0x2733, 0x2734), (0x2744, 0x2744), (0x2747, 0x2747),
    (0x274C, 0x274C), (0x274E, 0x274E), (0x2753, 0x2755), (0x2757, 0x2757),
    (0x2763, 0x2767), (0x2795, 0x2797), (0x27A1, 0x27A1), (0x27B0, 0x27B0),
    (0x27BF, 0x27BF), (0x2934, 0x2935), (0x2B05, 0x2B07), (0x2B1B, 0x2B1C),
    (0x2B50, 0x2B50), (0x2B55, 0x2B55), (0x3030, 0x3030), (0x303D, 0x303D),
    (0x3297, 0x3297), (0x3299, 0x3299), (0x1F000, 0x1F0FF), (0x1F10D, 0x1F10F),
    (0x1F12F, 0x1F12F), (0x1F16C, 0x1F171), (0x1F17E, 0x1F17F), (0x1F18E, 0x1F18E),
    (0x1F191, 0x1F19A), (0x1F1AD, 0x1F1E5), (0x1F201, 0x1F20F), (0x1F21A, 0x1F21A),
    (0x1F22F, 0x1F22F), (0x1F232, 0x1F23A), (0x1F23C, 0x1F23F), (0x1F249, 0x1F3FA),
    (0x1F400, 0x1F53D), (0x1F546, 0x1F64F), (0x1F680, 0x1F6FF), (0x1F774, 0x1F77F),
    (0x1F7D5, 0x1F7FF), (0x1F80C, 0x1F80F), (0x1F848, 0x1F84F), (0x1F85A, 0x1F85F),
    (0x1F888, 0x1F88F), (0x1F8AE, 0x1F8FF), (0x1F90C, 0x1F93A), (0x1F93C, 0x1F945),
    (0x1F947, 0x1FFFD))
# Scripts that UAX#29 leaves to other rules: Han and Hiragana give one token per
# character, Katakana and South-East Asian scripts (Thai, Lao, Myanmar, Khmer, ...)
# one token per run.
_SCRIPT_CLASSES = (
    ("H", ((0x2E80, 0x2FDF), (0x3005, 0x3005), (0x3007, 0x3007), (0x3021, 0x3029),
           (0x3038, 0x303B), (0x3400, 0x4DBF), (0x4E00, 0x9FFF), (0xF900, 0xFAFF),
           (0x20000, 0x3134F))),
    ("R", ((0x3041, 0x3096), (0x309D, 0x309F))),
    ("K", ((0x3031, 0x3035), (0x309B, 0x309C), (0x30A0, 0x30FA), (0x30FC, 0x30FF),
           (0x31F0, 0x31FF), (0x32D0, 0x32FE), (0x3300, 0x3357), (0xFF66, 0xFF9D))),
    ("S", ((0x0E01, 0x0E4F), (0x0E5A, 0x0ECF), (0x0EDA, 0x0EFF), (0x1000, 0x103F),
           (0x104A, 0x108F), (0x109A, 0x109F), (0x1780, 0x17DF), (0x1950, 0x19DF),
           (0x1A20, 0x1AAF), (0xA9E0, 0xA9FF), (0xAA60, 0xAADF))),
)
# Word-break punctuation: MidLetter (M) joins letters, MidNum (C) joins digits,
# MidNumLet and the apostrophe (P) join both, ExtendNumLet (U) joins anything.
_PUNCTUATION_CLASSES = {
    **dict.fromkeys(":\u00b7\u0387\u055f\u05f4\u2027\ufe13\ufe55\uff1a", "M"),
    **dict.fromkeys(",;\u037e\u0589\u060c\u060d\u066c\u07f8\u2044"
                    "\ufe10\ufe14\ufe50\ufe54\uff0c\uff1b", "C"),
    **dict.fromkeys(".'\u2018\u2019\u2024\ufe52\uff07\uff0e", "P"),
    "\u202f": "U", "\u200d": "Z", "\ufe0f": "V", "\u200b": " ",
    "\uff9e": "X", "\uff9f": "X",     # halfwidth kana voicing marks extend the character before
}


def _in_ranges(code, ranges):
    return any(lo <= code <= hi for lo, hi in ranges)


def char_class(ch):
    """Word-break class of one character, as a one-letter code (" " = breaks, ignored)."""
    if ch in _PUNCTUATION_CLASSES:
        return _PUNCTUATION_CLASSES[ch]
    code = ord(ch)
    if _in_ranges(code, _PICTOGRAPHIC):
        return "E"
    if 0x1F3FB <= code <= 0x1F3FF:
        return "F"                                  # emoji skin-tone modifier
    if 0x1F1E6 <= code <= 0x1F1FF:
        return "I"                                  # regional indicator (flags)
    for letter, ranges in _SCRIPT_CLASSES:
        if _in_ranges(code, ranges):
            return letter
    category = unicodedata.category(ch)
    if category == "Nd":
        return "N"
    if category in ("Mn", "Mc", "Me", "Cf"):
        return "X"                                  # Extend/Format: glued to what precedes
    if category == "Pc":
        return "U"
    if category in ("Lu", "Ll", "Lt", "Lm", "Lo", "Nl") or 0x24B6 <= code <= 0x24E9:
        return "L"
    return " "


class _CharClassTable(dict):
    """str.translate table that classifies each new character once."""

    def __missing__(self, code):
        self[code] = char_class(chr(code))
        return self[code]


_CHAR_CLASSES = _CharClassTable()
# Lucene's StandardTokenizerImpl.jflex, on class codes. "x" = the character plus any
# Extend/Format/ZWJ characters glued to it (UAX#29 rule WB4).
_EXT = "[XVZ]*"
_LETTERS = f"L{_EXT}(?:(?:U{_EXT})*L{_EXT}|[MP]{_EXT}L{_EXT})*"
_DIGITS = f"N{_EXT}(?:(?:U{_EXT})*N{_EXT}|[CP]{_EXT}N{_EXT})*"
_KATAKANA = f"K{_EXT}(?:(?:U{_EXT})*K{_EXT})*"
_BLOCK = f"(?:{_KATAKANA}|(?:{_LETTERS}|{_DIGITS})+)"
_WORD = f"(?:U{_EXT})*{_BLOCK}(?:(?:U{_EXT})+{_BLOCK})*(?:U{_EXT})*"
# An emoji keeps the Extend/ZWJ characters after it, except a ZWJ that joins it to
# the next emoji (a regex takes the first match where JFlex takes the longest).
_EMOJI_EXT = "(?:X|Z(?!Z*[EF]))*"
_EMOJI_UNIT = f"Z*(?:E{_EMOJI_EXT}(?:V|F{_EMOJI_EXT})?|F{_EMOJI_EXT})"
_EMOJI = f"{_EMOJI_UNIT}(?:Z+{_EMOJI_UNIT})*|I[XZ]*I[XZ]*"
_TOKEN_RE = re.compile(f"{_EMOJI}|{_WORD}|(?:S{_EXT})+|H{_EXT}|R{_EXT}")


def tokenize(text):
    """Lucene StandardTokenizer: the UAX#29 words of ``text`` (original case)."""
    classes = text.translate(_CHAR_CLASSES)
    return [text[m.start():m.end()] for m in _TOKEN_RE.finditer(classes)]


def _lucene_lower(token):
    # Java's Character.toLowerCase maps one character to one character; Python's
    # str.lower() differs only on a few (final sigma, dotted capital I).
    if token.isascii():
        return token.lower()
    return "".join(c.lower()[0] for c in token)


_STEM_CACHE = {}


def analyze(text):
    """Index terms of ``text``: tokens, possessive 's dropped, lower case, stop words
    removed, Porter-stemmed (the DefaultEnglishAnalyzer pipeline)."""
    terms = []
    for token in tokenize(text):
        token = _lucene_lower(token)
        if len(token) >= 2 and token[-1] == "s" and token[-2] in "'\u2019\uff07":
            token = token[:-2]                      # EnglishPossessiveFilter
        if token in STOP_WORDS:
            continue
        stem = _STEM_CACHE.get(token)
        if stem is None:
            stem = _STEM_CACHE[token] = porter_stem(token)
        terms.append(stem)
    return terms


# ---- Porter stemmer (Lucene's PorterStemmer: the 1980 algorithm with Porter's own
# two departures, "bli" -> "ble" and "logi" -> "log") ----

def _consonant(word, i):
    ch = word[i]
    if ch in "aeiou":
        return False
    if ch == "y":
        return i == 0 or not _consonant(word, i - 1)
    return True


def _measure(stem):
    """m in [C](VC)^m[V]: the number of vowel-consonant sequences."""
    kinds = "".join("c" if _consonant(stem, i) else "v" for i in range(len(stem)))
    return len(re.findall("v+c+", kinds))


def _has_vowel(stem):
    return any(not _consonant(stem, i) for i in range(len(stem)))


def _double_consonant(word):
    return len(word) >= 2 and word[-1] == word[-2] and _consonant(word, len(word) - 1)


def _cvc(word):
    """consonant-vowel-consonant at the end, the last not w, x or y (hop, but not snow)."""
    n = len(word)
    return (n >= 3 and _consonant(word, n - 1) and not _consonant(word, n - 2)
            and _consonant(word, n - 3) and word[-1] not in "wxy")


_STEP3_SUFFIXES = (("ational", "ate"), ("tional", "tion"), ("enci", "ence"), ("anci", "ance"),
                   ("izer", "ize"), ("bli", "ble"), ("alli", "al"), ("entli", "ent"),
                   ("eli", "e"), ("ousli", "ous"), ("ization", "ize"), ("ation", "ate"),
                   ("ator", "ate"), ("alism", "al"), ("iveness", "ive"), ("fulness", "ful"),
                   ("ousness", "ous"), ("aliti", "al"), ("iviti", "ive"), ("biliti", "ble"),
                   ("logi", "log"))
_STEP4_SUFFIXES = (("icate", "ic"), ("ative", ""), ("alize", "al"), ("iciti", "ic"),
                   ("ical", "ic"), ("ful", ""), ("ness", ""))
_STEP5_SUFFIXES = ("al", "ance", "ence", "er", "ic", "able", "ible", "ant", "ement", "ment",
                   "ent", "ion", "ou", "ism", "ate", "iti", "ous", "ive", "ize")


def _replace_first_suffix(word, table, min_measure):
    # Lucene stops at the first suffix that matches, replaced or not.
    for suffix, replacement in table:
        if word.endswith(suffix):
            stem = word[:-len(suffix)]
            return stem + replacement if _measure(stem) > min_measure else word
    return word


def porter_stem(word):
    """Porter stem of a lower-case token, exactly as Lucene's PorterStemFilter."""
    if len(word) <= 2:
        return word
    # step 1: plurals, -ed, -ing
    if word.endswith("s"):
        if word.endswith("sses"):
            word = word[:-2]
        elif word.endswith("ies"):
            word = word[:-2]
        elif word[-2] != "s":
            word = word[:-1]
    if word.endswith("eed"):
        if _measure(word[:-3]) > 0:
            word = word[:-1]
    else:
        stem = (word[:-2] if word.endswith("ed") else
                word[:-3] if word.endswith("ing") else None)
        if stem is not None and _has_vowel(stem):
            word = stem
            if word.endswith(("at", "bl", "iz")):
                word += "e"
            elif _double_consonant(word):
                if word[-1] not in "lsz":
                    word = word[:-1]
            elif _measure(word) == 1 and _cvc(word):
                word += "e"
    # step 2: terminal y -> i when the stem has a vowel
    if word.endswith("y") and _has_vowel(word[:-1]):
        word = word[:-1] + "i"
    # steps 3 and 4: double suffixes to single ones, then -ic-, -full, -ness
    if len(word) > 1:
        word = _replace_first_suffix(word, _STEP3_SUFFIXES, 0)
    word = _replace_first_suffix(word, _STEP4_SUFFIXES, 0)
    # step 5: drop -ant, -ence, ... when m > 1 (-ion only after s or t)
    if len(word) > 1:
        for suffix in _STEP5_SUFFIXES:
            if word.endswith(suffix):
                stem = word[:-len(suffix)]
                if suffix == "ion" and not stem.endswith(("s", "t")):
                    continue
                if _measure(stem) > 1:
                    word = stem
                break
    # step 6: drop a final -e, and -ll -> -l, when m is large enough
    if word.endswith("e"):
        m = _measure(word[:-1])
        if m > 1 or (m == 1 and not _cvc(word[:-1])):
            word = word[:-1]
    if word.endswith("l") and _double_consonant(word) and _measure(word) > 1:
        word = word[:-1]
    return word


# ---- BM25 with Lucene's float32 arithmetic ----

_FLOAT32 = struct.Struct("<f")


def f32(x):
    """Round a Python float to float32, like one Java float operation."""
    return _FLOAT32.unpack(_FLOAT32.pack(x))[0]


def f32_list(values):
    """``f32`` on a whole list at once (array('f') rounds to float32 in C)."""
    return array.array("f", values).tolist()


def length_to_norm_byte(length):
    """Lucene's SmallFloat.intToByte4: exact below 24, then 4 significant bits."""
    if length < 24:
        return length
    rest = length - 24
    if rest < 8:
        return 24 + rest
    shift = rest.bit_length() - 4
    return 24 + (((rest >> shift) & 0x07) | ((shift + 1) << 3))


def norm_byte_to_length(byte):
    """Lucene's SmallFloat.byte4ToInt: the document length BM25 sees."""
    if byte < 24:
        return byte
    code = byte - 24
    shift = (code >> 3) - 1
    return 24 + (code if shift < 0 else ((code & 0x07) | 0x08) << shift)


class BM25Index:
    """Lucene's BM25Similarity (Lucene 9) over a list of (doc id, text).

    score(term, doc) = w - w / (1 + freq * 1 / (k1 * (1 - b + b * L / avgdl)))
    with w = boost * idf, idf = ln(1 + (N - df + 0.5) / (df + 0.5)), L the document
    length after the one-byte norm round trip, every operation in float32 as in Java;
    term scores are summed in double and the sum rounded to float32. A query is a
    bag of words: each distinct term once, boosted by its count.
    """

    def __init__(self, docs, k1=0.9, b=0.4):
        self.ids = [doc_id for doc_id, _ in docs]
        self.postings = defaultdict(list)           # term -> [(doc, freq)]
        self.lengths = []
        for doc, (_, text) in enumerate(docs):
            terms = analyze(text)
            self.lengths.append(len(terms))
            for term, freq in Counter(terms).items():
                self.postings[term].append((doc, freq))
        self.n_docs = sum(1 for n in self.lengths if n)
        self.avgdl = f32(sum(self.lengths) / self.n_docs) if self.n_docs else 0.0
        k1, b = f32(k1), f32(b)
        one_minus_b = f32(1 - b)
        norm_inverse = [f32(1 / f32(k1 * f32(one_minus_b + f32(f32(b * norm_byte_to_length(i))
                                                                    / self.avgdl))))
                        if self.avgdl else 0.0 for i in range(256)]
        self.doc_norm_inverse = [norm_inverse[length_to_norm_byte(n)] for n in self.lengths]
        self._unit_scores = {}                      # term -> [(doc, score at boost 1)]

    def idf(self, term):
        df = len(self.postings.get(term, ()))
        return f32(math.log(1 + (self.n_docs - df + 0.5) / (df + 0.5)))

    def term_scores(self, term, boost=1.0):
        """[(doc, float32 BM25 score of ``term``)] for the documents containing it."""
        if boost == 1.0 and term in self._unit_scores:
            return self._unit_scores[term]
        postings = self.postings.get(term, [])
        weight = f32(f32(boost) * self.idf(term))
        denominators = f32_list([1 + t for t in f32_list(
            [freq * self.doc_norm_inverse[doc] for doc, freq in postings])])
        quotients = f32_list([weight / d for d in denominators])
        scores = list(zip((doc for doc, _ in postings), f32_list([weight - q for q in quotients])))
        if boost == 1.0:
            self._unit_scores[term] = scores
        return scores

    def search(self, query, k=50):
        """Top ``k`` (doc id, float32 score), by score then by id, like Anserini."""
        totals = defaultdict(float)
        for term, count in Counter(analyze(query)).items():
            for doc, score in self.term_scores(term, float(count)):
                totals[doc] += score
        hits = [(self.ids[doc], f32(total)) for doc, total in totals.items()]
        hits.sort(key=lambda hit: (-hit[1], hit[0]))
        return hits[:k]


def index_text(product):
    """What the original indexes: title, description, first bullet point and the
    options ("name: v1, v2, and name2: ..."), lower-cased."""
    option_text = ", and ".join(f"{name}: {', '.join(values)}"
                                for name, values in product["options"].items())
    first_bullet = product["BulletPoints"][0] if product["BulletPoints"] else ""
    return " ".join([product["Title"], product["Description"], first_bullet, option_text]).lower()


# =============================================================================
# Pages: the text the original gets from its HTML with BeautifulSoup
# =============================================================================
# Each page is a list of text segments, joined with " [SEP] ". A segment is one
# text node of the HTML, stripped. BeautifulSoup turns a text node made only of
# ASCII whitespace into "\n" (dropped) or " " (kept as an empty segment), which is
# why an empty bullet point still shows up as an empty segment.

SEP = " [SEP] "
RESULTS_PER_PAGE = 10
SEARCH_RETURN_N = 50


def text_node(text):
    """Segments that one rendered text node contributes ([] or [stripped text])."""
    if text == "":
        return []
    if text.strip(" \n\t\f\r") == "":
        return [] if "\n" in text else [""]
    return [text.strip()]


class Page:
    """One rendered page: its text segments, clickables and the URL-like key that the
    original uses to tell pages apart."""

    def __init__(self, kind, segments, buttons=(), links=(), options=(), has_search_bar=False,
                 url=""):
        self.kind = kind
        self.segments = segments
        self.has_search_bar = has_search_bar
        self.url = url
        # clickable text -> (what it is, option name); a later option value with the
        # same text replaces the target but keeps its place, like a Python dict.
        self.clickables = {text.lower(): ("button", None) for text in buttons}
        self.clickables.update((asin.lower(), ("link", None)) for asin in links)
        self.clickables.update((value, ("option", name)) for name, value in options)

    @property
    def text(self):
        return SEP.join(self.segments)

    def available_actions(self):
        return {"has_search_bar": self.has_search_bar, "clickables": list(self.clickables)}


def _instruction_segments(instruction):
    return ["Instruction:"] + text_node(instruction)


def search_page(instruction):
    return Page("index", ["WebShop"] + _instruction_segments(instruction) + ["Search"],
                buttons=["Search"], has_search_bar=True)


def results_page(instruction, products, page, total, url=""):
    """Page ``page`` of the results; ``products`` are the ones on this page."""
    buttons = ["Back to Search"] + (["< Prev"] if page > 1 else []) + ["Next >"]
    segments = (_instruction_segments(instruction)
                + ["Back to Search", f"Page {page} (Total results: {total})"] + buttons[1:])
    for product in products:
        segments += [product["asin"]] + text_node(product["Title"]) + text_node(product["Price"])
    return Page("search_results", segments, buttons, [p["asin"] for p in products], url=url)


def item_page(instruction, product, show_attrs=False, url=""):
    """The product page. Quirk: chosen options are not marked in the text."""
    segments = _instruction_segments(instruction) + ["Back to Search", "< Prev"]
    options = []
    for name, values in product["options"].items():
        segments += text_node(name)
        for value in values:
            segments += text_node(value)
            options.append((name, value))
    segments += text_node(product["Title"]) + [f"Price: {product['Price']}",
                                                f"Rating: {product['Rating']}"]
    buttons = ["Back to Search", "< Prev", "Description", "Features", "Reviews"]
    buttons += ["Attributes"] * show_attrs + ["Buy Now"]
    return Page("item_page", segments + buttons[2:], buttons, options=options, url=url)


def item_sub_page(instruction, product, sub_page, url=""):
    """Description, Features (bullet points), Reviews (none) or Attributes page."""
    if sub_page == "Description":
        content = text_node(product["Description"])
    elif sub_page == "Features":
        content = [s for bullet in product["BulletPoints"] for s in text_node(f" {bullet}")]
    elif sub_page == "Attributes":
        content = [s for attribute in product["Attributes"] for s in text_node(f" {attribute}")]
        for field in ("category", "query", "product_category"):
            content += text_node(product[field])
    else:
        content = []    # reviews are not loaded by the original's current code
    return Page("item_sub_page", _instruction_segments(instruction) + ["Back to Search", "< Prev"]
                + content, ["Back to Search", "< Prev"], url=url)


def done_page(asin, options, reward):
    """The thank-you page. Its hidden debug fields stay empty ("None") as in the
    original, which renders it without them; options appear as Flask's tojson."""
    options_json = json.dumps(options, sort_keys=True, ensure_ascii=True)
    for char, escape in (("<", "\\u003c"), (">", "\\u003e"), ("&", "\\u0026"), ("'", "\\u0027")):
        options_json = options_json.replace(char, escape)
    segments = ["Thank you for shopping with us!", "Your code:", "None",
                "(Paste it in your MTurk interface.)", "Purchased", "asin", asin,
                "options", options_json]
    for label in ("attrs", "category", "query", "product category"):
        segments += [label, "None"]
    segments += ["Target", "asin", "options", "attrs", "price upper", "instuction text",
                 "category", "product category", "query", "Goal", "None", "Reward",
                 "Your score (min 0.0, max 1.0)", str(reward), "Reward Details", "None"]
    return Page("done", segments, url="done")


def compact_observation(page, instruction):
    """What prompts show: the segments after the instruction, each one quoted."""
    segments, instruction = page.segments, instruction.strip()
    if instruction in segments:
        segments = segments[segments.index(instruction) + 1:]
    return SEP.join(f"'{s}'" for s in segments)


def admissible_actions(page):
    """Actions the page accepts: ``search[<your query>]`` and one click per clickable.
    The search button itself is left out, since the original refuses ``click[search]``."""
    actions = ["search[<your query>]"] if page.has_search_bar else []
    return actions + [f"click[{c}]" for c in page.clickables if c != "search"]


# =============================================================================
# Reward
# =============================================================================

COLOR_SET = (
    "alabaster apricot aqua ash asphalt azure banana beige black blue blush bordeaux "
    "bronze brown burgundy camel camo caramel champagne charcoal cheetah chestnut "
    "chocolate christmas coffee cognac copper coral cranberry cream crystal dark denim "
    "eggplant elephant espresso fuchsia gold granite grape graphite grass gray green "
    "grey heather indigo ivory ivy khaki lavender lemon leopard light lilac lime magenta "
    "maroon mauve merlot midnight mint mocha multicolor mushroom mustard natural navy "
    "nude olive orange peach pewter pink plum purple rainbow red rose royal rust sand "
    "sapphire seashell silver skull slate steel stone stonewash sunflower tan taupe teal "
    "tiger turquoise violet walnut wheat white wine yellow").split()
REWARD_MODES = ("faithful", "fixed")

_NON_WORD = re.compile(r"(?ui)\W")
_LATIN1_UPPER_HALF = dict.fromkeys(range(128, 256))


def full_process(s):
    """thefuzz's full_process(force_ascii=True): str() of non-strings (so a tuple
    becomes "('color', 'blue')"), characters 128-255 deleted, non-word -> space,
    lower case, stripped."""
    s = str(s).translate(_LATIN1_UPPER_HALF)
    return _NON_WORD.sub(" ", s).lower().strip()


def fuzz_ratio(a, b):
    """thefuzz's ratio on the pure-Python path: difflib, rounded half to even."""
    if a == b:
        return 100
    if not a or not b:
        return 0
    return int(round(100 * difflib.SequenceMatcher(None, a, b).ratio()))


def token_set_ratio(a, b):
    """thefuzz 0.19.0 token_set_ratio: compare the sorted shared tokens with each side's
    full token list. A subset scores 100 ("large" vs "x-large")."""
    if a is None or b is None:
        return 0
    tokens_a, tokens_b = set(full_process(a).split()), set(full_process(b).split())
    if not tokens_a or not tokens_b:
        return 0
    shared = " ".join(sorted(tokens_a & tokens_b))
    with_a = (shared + " " + " ".join(sorted(tokens_a - tokens_b))).strip()
    with_b = (shared + " " + " ".join(sorted(tokens_b - tokens_a))).strip()
    return max(fuzz_ratio(shared, with_a), fuzz_ratio(shared, with_b), fuzz_ratio(with_a, with_b))


def normalize_color(option):
    """The first colour of COLOR_SET found in the option. For a string this is a
    substring test ("standard" -> "tan"); for a (name, value) tuple it only matches
    a value that is exactly a colour."""
    for color in COLOR_SET:
        if color in option:
            return color
    return option


_TITLE_WORD = re.compile(r"[a-z0-9]+")


def heuristic_title_nouns(title):
    """Stand-in for spaCy's nouns when title_nouns.json lacks the title: the title's
    lower-case alphanumeric words, without stop words, bare numbers and single
    characters. On the 1,000-product goldens it gives the spaCy r_type in 978 of
    1,000 cases (adjectives such as "compatible" slip through)."""
    return [w for w in _TITLE_WORD.findall(title.lower())
            if w not in STOP_WORDS and not w.isdigit() and len(w) > 1]


def title_nouns_of(title, title_nouns):
    """spaCy's nouns of a title from the table, or the heuristic when it is not there."""
    if title_nouns is not None and title in title_nouns:
        return title_nouns[title]
    return heuristic_title_nouns(title)


def nouns_are_exact(title_nouns, *titles):
    """True when every title is in the noun table, i.e. the type term is exact."""
    return title_nouns is not None and all(title in title_nouns for title in titles)


def type_reward(product, goal, title_nouns=None):
    """r_type: 1 for the right kind of product, down to 0 when no title noun is shared."""
    query_match = product["query"] == goal["query"]
    categories_p = {c.strip() for c in product["product_category"].split("›")}
    categories_g = {c.strip() for c in goal["product_category"].split("›")}
    category_match = len(categories_p & categories_g) >= 2
    nouns_p = title_nouns_of(product["name"], title_nouns)
    nouns_g = title_nouns_of(goal["name"], title_nouns)
    title_score = len(set(nouns_p) & set(nouns_g)) / len(nouns_g) if nouns_g else 0.2
    r_type = 1.0 if (query_match or category_match or title_score > 0.2) else 0.5
    if title_score < 0.1:
        r_type = 0.1
    if title_score == 0.0:
        r_type = 0.0
    return {"r_type": r_type, "query_match": query_match, "category_match": category_match,
            "title_score": title_score}


def attribute_matches(product, goal):
    """Goal attributes found fuzzily among the product's attributes, or verbatim in
    its title, bullet points or description."""
    texts = (product["Title"].lower(), " ".join(product["BulletPoints"]).lower(),
             product["Description"].lower())
    return sum(1 for g_attr in goal["attributes"]
               if any(token_set_ratio(p_attr, g_attr) > 85 for p_attr in product["Attributes"])
               or any(g_attr in text for text in texts))


def option_matches(purchased_options, goal_options):
    """Goal options matched (token_set_ratio > 85) by a chosen option, after colour
    normalisation of both sides."""
    purchased = [normalize_color(o) for o in purchased_options]
    return sum(1 for g in map(normalize_color, goal_options)
               if any(token_set_ratio(p, g) > 85 for p in purchased))


def get_reward(product, goal, price, options, mode="faithful", title_nouns=None):
    """(reward in [0, 1], the original's verbose breakdown) for buying ``product`` at
    ``price`` with ``options`` ({name: value}) when the goal is ``goal``.

    reward = r_type * (attributes matched + options matched + [price <= budget])
                    / (n attributes + n options + 1)
    ``faithful`` (default) keeps the original's bug of passing the goal options as
    (name, value) tuples; ``fixed`` passes their values.
    """
    if mode not in REWARD_MODES:
        raise ValueError(f"reward mode must be one of {REWARD_MODES}, not {mode!r}")
    type_info = type_reward(product, goal, title_nouns)
    r_price = price <= goal["price_upper"]
    n_attr = attribute_matches(product, goal)
    goal_options = goal["goal_options"]
    if isinstance(goal_options, dict):   # human goals give a plain list of values
        # quirk: the original passes .items(), so each goal option is a (name, value)
        # tuple that normalize_color and token_set_ratio see as "('size', 'large')"
        goal_options = goal_options.items() if mode == "faithful" else goal_options.values()
    n_option = option_matches(list(options.values()), goal_options)
    n_terms = len(goal["attributes"]) + len(goal["goal_options"]) + 1
    reward = (n_attr + n_option + r_price) / n_terms * type_info["r_type"]
    info = {"r_type": type_info["r_type"], "r_att": n_attr / len(goal["attributes"]),
            "w_att": len(goal["attributes"]) / n_terms, "query_match": type_info["query_match"],
            "category_match": type_info["category_match"], "title_score": type_info["title_score"]}
    if goal["goal_options"]:
        info["r_option"] = n_option / len(goal["goal_options"])
        info["w_option"] = len(goal["goal_options"]) / n_terms
    info["r_price"] = r_price
    info["w_price"] = 1 / n_terms
    return reward, info


# =============================================================================
# Environment
# =============================================================================

BUILTIN = "builtin"  # data_dir naming the built-in catalogue


class WebShop:
    """The shared, read-only part: catalogue, prices, goals, split and search index.

    ``data_dir`` None -> $WEBSHOP_DATA if set, else the built-in catalogue ("builtin": that one). The
    random draws (prices of ranges, goal budgets) follow ``random.seed(seed)`` set
    right before the original's ``load_products`` (seed 42 gives the goldens').
    """

    def __init__(self, data_dir=None, reward_mode="faithful", seed=42, human_goals=False):
        if reward_mode not in REWARD_MODES:
            raise ValueError(f"reward_mode must be one of {REWARD_MODES}, not {reward_mode!r}")
        data_dir = data_dir if data_dir is not None else os.environ.get("WEBSHOP_DATA") or None
        data_dir = None if data_dir == BUILTIN else data_dir  # "builtin": the built-in one, whatever the variable says
        self.builtin = data_dir is None
        if self.builtin:
            raw_products, attributes = builtin_catalogue()
            human, self.title_nouns = None, None
            if human_goals:
                raise ValueError("The built-in catalogue has no human goals. " + DATA_HELP)
        else:
            raw_products, attributes, human, self.title_nouns = load_data_folder(data_dir, human_goals)
        self.data_dir, self.reward_mode, self.seed = data_dir, reward_mode, seed
        rng = random.Random(seed)
        self.products = process_products(raw_products, attributes, human)
        self.product_by_asin = {p["asin"]: p for p in self.products}
        self.prices = draw_product_prices(self.products, rng)
        self.goals = (human_goals_from if human_goals else synthetic_goals)(
            self.products, self.prices, rng)
        self.valid_goal_indices, self.train_goal_indices = split_goals(len(self.goals))
        self.index = BM25Index([(p["asin"], index_text(p)) for p in self.products])
        self.asins_by_attribute = defaultdict(set)
        for product in self.products:
            for attribute in product["Attributes"]:
                self.asins_by_attribute[attribute].add(product["asin"])

    def search(self, query, k=SEARCH_RETURN_N):
        """BM25 top ``k`` as [(asin, float32 score)]."""
        return self.index.search(query, k)

    def find_products(self, keywords, rng):
        """The original's get_top_n_product_from_keywords (``keywords``: the query split
        on single spaces). ``<q> query`` and ``<c> category`` list every matching
        product in catalogue order; ``<r>`` draws 50 at random; ``<a> attribute``
        lists the products with that attribute."""
        prefix = keywords[0]
        if prefix == "<r>":
            return rng.sample(self.products, k=min(SEARCH_RETURN_N, len(self.products)))
        if prefix == "<a>":
            asins = self.asins_by_attribute.get(" ".join(keywords[1:]).strip(), set())
            return [p for p in self.products if p["asin"] in asins]
        if prefix == "<c>":
            category = keywords[1].strip() if len(keywords) > 1 else None
            return [p for p in self.products if p["category"] == category]
        if prefix == "<q>":
            query = " ".join(keywords[1:]).strip()
            return [p for p in self.products if p["query"] == query]
        return [self.product_by_asin[asin] for asin, _ in self.search(" ".join(keywords))]


_ACTION_RE = re.compile(r"(.+)\[(.+)\]")


def parse_action(action):
    """("search"|"click"|anything, argument or None), with the original's greedy
    pattern: "click[a] trailing" -> ("click", "a"), "search[a [b]]" -> ("search[a ", "b]")."""
    match = _ACTION_RE.match(action)
    return (action, None) if match is None else match.groups()


def page_name_of(url):
    """The original tells pages apart by looking for these names in the URL, which
    also holds the query and options. Quirk kept: a query containing
    "search_results" makes an item page look like a results page."""
    for name in ("search_results", "item_page", "item_sub_page", "done"):
        if name in url:
            return name
    return ""


class WebShopEnv:
    """One episode at a time on a shared ``WebShop`` (cheap to create).

    ``reset(goal_index)`` -> (observation, info); ``step(action)`` -> (observation,
    reward, done, info), with actions ``search[query]`` and ``click[text]``. Refused
    actions change nothing and have ``info["valid"] = False``.
    """

    def __init__(self, shop, show_attrs=False, seed=0):
        self.shop = shop
        self.show_attrs = show_attrs
        self.rng = random.Random(seed)      # only for the "<r>" search prefix
        self.goal = None

    # ---- episode ----
    def reset(self, goal_index):
        self.goal_index = goal_index
        self.goal = self.shop.goals[goal_index]
        self.instruction = self.goal["instruction_text"]
        self.session = f"{goal_index}"
        self._to_search_page()
        return self.page.text, self._info()

    def step(self, action):
        if self.goal is None:
            raise RuntimeError("call reset(goal_index) before step()")
        name, arg = parse_action(action)
        arg = arg.lower() if arg is not None else None
        reward, breakdown, approximate, done, valid = 0.0, None, False, False, True
        if name == "search" and arg:
            self._show_results(arg.split(" "), page=1)
        elif name == "click" and arg in self.page.clickables and arg != "search":
            if arg == "buy now":
                reward, breakdown, approximate = self._buy()
                done = True
            else:
                self._click(arg)
        else:
            valid = False   # the original answers reward 0 and leaves the page as it is
        info = self._info()
        info.update(valid=valid, score=reward, won=reward == 1.0, reward_breakdown=breakdown,
                    reward_approximate=approximate)
        # Quirk kept: only the purchase step says done; the original does not stop an
        # episode by itself, and search[...] still works on the thank-you page.
        return self.page.text, reward, done, info

    # ---- transitions, as the original's SimServer.receive ----
    def _to_search_page(self):
        self.keywords, self.page_number, self.asin, self.options = None, None, None, {}
        self.page = search_page(self.instruction)

    def _show_results(self, keywords, page):
        self.keywords, self.page_number = keywords, page
        self.asin, self.options = None, {}
        found = self.shop.find_products(keywords, self.rng)
        shown = found[(page - 1) * RESULTS_PER_PAGE:page * RESULTS_PER_PAGE]
        url = f"/search_results/{self.session}/{'+'.join(keywords)}/{page}"
        self.page = results_page(self.instruction, shown, page, len(found), url)

    def _show_item(self):
        product = self.shop.product_by_asin[self.asin]
        url = (f"/item_page/{self.session}/{self.asin}/{'+'.join(self.keywords)}/"
               f"{self.page_number}/{json.dumps(self.options)}")
        self.page = item_page(self.instruction, product, self.show_attrs, url)

    def _click(self, clickable):
        current = page_name_of(self.page.url)
        if clickable == "back to search":
            self._to_search_page()
        elif clickable == "next >" and current == "search_results":
            self._show_results(self.keywords, self.page_number + 1)
        elif clickable == "< prev" and current == "search_results":
            self._show_results(self.keywords, self.page_number - 1)
        elif clickable == "< prev" and current == "item_sub_page":
            self._show_item()
        elif clickable == "< prev" and current == "item_page":
            self._show_results(self.keywords, self.page_number)   # quirk: options forgotten
        elif clickable in ("description", "features", "reviews", "attributes"):
            sub_page = clickable.capitalize()
            url = (f"/item_sub_page/{self.session}/{self.asin}/{'+'.join(self.keywords)}/"
                   f"{self.page_number}/{sub_page}/{self.options}")
            self.page = item_sub_page(self.instruction, self.shop.product_by_asin[self.asin],
                                      sub_page, url)
        else:
            kind, option_name = self.page.clickables[clickable]
            if kind == "link":
                self.asin = clickable.upper()
            elif kind == "option":
                self.options[option_name] = clickable
            self._show_item()

    def _buy(self):
        product = self.shop.product_by_asin[self.asin]
        title_nouns = self.shop.title_nouns
        reward, breakdown = get_reward(product, self.goal, self.shop.prices[self.asin],
                                       self.options, self.shop.reward_mode, title_nouns)
        self.page = done_page(self.asin, self.options, reward)
        return reward, breakdown, not nouns_are_exact(title_nouns, product["name"], self.goal["name"])

    def _info(self):
        return {"instruction": self.instruction, "goal": self.goal,
                "category": SKILL_CATEGORY.get(self.goal["category"], self.goal["category"]),
                "available_actions": self.page.available_actions(),
                "admissible": admissible_actions(self.page),
                "compact_obs": compact_observation(self.page, self.instruction)}


# =============================================================================
# Benchmark
# =============================================================================

def benchmark(data_dir=None, queries=None):
    """Timings: catalogue load + index build, search latency, env step time."""
    start = time.perf_counter()
    shop = WebShop(data_dir)
    load_s = time.perf_counter() - start
    queries = queries or [g["instruction_text"] for g in shop.goals[:100]]
    latencies = []
    for query in queries:
        start = time.perf_counter()
        shop.search(query)
        latencies.append(time.perf_counter() - start)
    env, step_times = WebShopEnv(shop), []
    for goal_index in shop.valid_goal_indices[:20]:
        env.reset(goal_index)
        goal = shop.goals[goal_index]
        actions = [f"search[{goal['instruction_text']}]", f"click[{goal['asin'].lower()}]"]
        actions += [f"click[{v}]" for v in goal["goal_options"].values()] + ["click[buy now]"]
        for action in actions:
            start = time.perf_counter()
            env.step(action)
            step_times.append(time.perf_counter() - start)
    latencies.sort()
    step_times.sort()
    return {"products": len(shop.products), "goals": len(shop.goals), "load_s": load_s,
            "search_median_ms": 1000 * latencies[len(latencies) // 2],
            "search_p95_ms": 1000 * latencies[int(0.95 * (len(latencies) - 1))],
            "step_median_ms": 1000 * step_times[len(step_times) // 2]}


class WebShopAdapter:
    """One WebShop episode on a shared catalogue, in retireopd.py's environment interface:
    reset() -> (observation, info), step(action) -> (observation, reward, done, info).

    The prompt shows webshop_env's compact observation (the page after the instruction, each
    segment quoted) and its admissible actions. Won = the purchase scored exactly 1.0; the
    reward slot is that score.
    """

    def __init__(self, shop, goal_index: int):
        self.env = WebShopEnv(shop)
        self.goal_index = goal_index

    def _info(self, info: dict, won: bool = False) -> dict:
        return {"task": self.instruction, "task_type": self.category, "admissible": info["admissible"],
                "won": won, **{k: info[k] for k in ("score", "valid") if k in info}}

    def reset(self):
        _, info = self.env.reset(self.goal_index)
        self.instruction, self.category = info["instruction"], info["category"]
        return info["compact_obs"], self._info(info)

    def step(self, action: str):
        _, score, done, info = self.env.step(action)
        return info["compact_obs"], score, done, self._info(info, bool(info.get("won", False)))


def _main(argv):
    if argv and argv[0] == "--benchmark":
        data_dir = argv[1] if len(argv) > 1 else None
        queries = None
        golden = Path(data_dir or ".") / "golden_search.jsonl"
        if data_dir and golden.is_file():
            queries = [json.loads(line)["query"] for line in golden.open(encoding="utf-8")]
        for key, value in benchmark(data_dir, queries).items():
            print(f"{key:>18}: {value:.3f}" if isinstance(value, float) else f"{key:>18}: {value}")
        return
    shop = WebShop(argv[0] if argv else None)
    env = WebShopEnv(shop)
    goal_index = shop.valid_goal_indices[0]
    obs, info = env.reset(goal_index)
    print(obs)
    goal = shop.goals[goal_index]
    actions = [f"search[{goal['query']}]", f"click[{goal['asin'].lower()}]"]
    actions += [f"click[{value}]" for value in goal["goal_options"].values()] + ["click[buy now]"]
    for action in actions:
        obs, reward, done, info = env.step(action)
        print(f"> {action}\n{info['compact_obs']}\nreward={reward} done={done}")


if __name__ == "__main__":
    _main(sys.argv[1:])
