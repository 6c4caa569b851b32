"""Order the published-number tests by model, so each model's weights are loaded once (test_published.py keeps one
model in memory at a time); tests that need two models run last. Only those tests move, within their own slots."""

MODEL_ORDER = ["gpt2", "pythia", "gpt2-large", "mistral-7b", "llama-3-8b"]


def _key(item):
    if "deficit_order" in item.name:  # needs GPT-2 and Llama-3-8B
        return len(MODEL_ORDER) + 1
    model = getattr(getattr(item, "callspec", None), "params", {}).get("key")
    return MODEL_ORDER.index(model) if model in MODEL_ORDER else len(MODEL_ORDER)


def pytest_collection_modifyitems(config, items):
    slots = [
        i for i, it in enumerate(items) if it.nodeid.split("::")[0].endswith("published/test_published.py")
    ]
    ordered = sorted((items[i] for i in slots), key=_key)  # stable: file order within a model
    for i, it in zip(slots, ordered):
        items[i] = it
