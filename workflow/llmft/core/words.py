"""The demo's synthetic vocabulary: words by category and the number words, which the synthetic SFT
rows (data.assets) and the preference stage's synthetic pairs (preference.data) both ask about."""

CATEGORIES = {
    "animal": "cat dog horse cow sheep goat tiger lion bear wolf fox mouse rabbit eagle owl".split(),
    "fruit": "apple banana cherry grape lemon mango melon orange peach pear plum kiwi fig lime".split(),
    "color": "red green blue yellow purple black white brown pink gray violet cyan teal gold".split(),
    "tool": "hammer saw drill wrench chisel shovel rake ladder pliers axe file brush clamp".split(),
    "vehicle": "car bus truck train bicycle boat ship plane tram van taxi scooter rocket".split(),
}
WORDS = sorted({w for ws in CATEGORIES.values() for w in ws})
NUMBER_WORDS = {2: "two", 3: "three", 4: "four", 5: "five"}
