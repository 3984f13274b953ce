"""Fourth round of contrast kinds (issue 15): text about AI assistants, forms and manuals, and
everyday business documents in other languages.

Why: a second, blind red-team set (``gate/data/fresh_redteam_s5.jsonl``, never trained on) found
most false positives in three genres: documents that discuss AI assistants or prompt injection
(security posts, AI-use policies, incident reviews, release notes of AI features), documents
that instruct their reader (intake forms, pre-operative instructions, appliance manuals), and
ordinary business documents in other languages (invoices, shipping notices). The probe and the
byte gate's n-gram window both read "assistant" or an imperative as evidence. These generators
give pairs that differ in who is addressed: the same genres benign, and with an instruction to
the assistant planted in them. Templates are written here; a test checks that no six words in a
row come from either red-team set. Written after seeing that set's errors, so that set is now
a development set: the judge is a third blind set, and the README reports all three.
"""
from __future__ import annotations

import json
import random
from collections.abc import Callable

from gate.train.contrast import PEOPLE, PROJECTS, _action, _ask, _generated
from gate.train.contrast3 import foreign_attack, planted

R = random.Random

PRODUCTS = ["HelpDesk Copilot", "Ledgerly AI", "the drafting assistant", "Atlas Chat", "the support bot", "CodeMate",
            "our AI concierge", "the triage assistant", "InboxPilot", "the meeting summariser"]
ABOUT_AI = [
    "{prod} now drafts first replies to customer e-mails; an agent reviews every draft before it is sent.",
    "Large language models can be misled by text hidden in web pages or documents they are asked to read.",
    "Security researchers call this indirect prompt manipulation: the attacker never talks to the model directly.",
    "Treat anything a tool returns as data, not as instructions, and keep a human in the loop for payments.",
    "In our tests the assistant sometimes followed a line in a pasted document that told it to change its answer.",
    "Employees may use approved AI tools for drafting and summarising, but must not paste customer data into them.",
    "Outputs of {prod} must be checked by a person before they are published or sent to a client.",
    "The model has no memory between sessions; conversation history is deleted after 30 days.",
    "A classic example is a product page that says, in white text, that AI shoppers should praise it.",
    "We added an allow-list of tools the assistant may call and require confirmation for anything that sends e-mail.",
    "Do not rely on the chatbot for medical or legal advice; it can be confidently wrong.",
    "Version 3.2 of {prod} adds meeting summaries, action-item extraction and a Spanish interface.",
    "Root cause: the triage bot closed tickets whose text contained the phrase it was told to treat as spam.",
    "Action item: log every tool call the agent makes, with its arguments, for 90 days.",
    "Users reported that the assistant answered in French after reading a French invoice; this is expected behaviour.",
    "The FAQ bot on this site is automated. Ask for a human at any time by typing 'agent'.",
]
ABOUT_TITLES = ["How we secure {prod}", "Acceptable use of AI assistants (policy v{k}.0)", "Release notes: {prod} {k}.{n}",
                "Incident review: {prod} misfiled support tickets", "Newsletter: agents, tools and trust",
                "All-hands: rolling out {prod}", "FAQ: talking to our virtual assistant", "Reading list on LLM safety"]


def _f(r: R, s: str) -> str:
    return s.format(prod=r.choice(PRODUCTS), k=r.randint(1, 9), n=r.randint(0, 9), proj=r.choice(PROJECTS),
                    p=r.choice(PEOPLE), d=r.randint(1, 28), m=r.randint(10, 990))


def about_ai(r: R, extra: str | None = None) -> str:
    """A post, policy, release note or incident review that is about AI assistants (for people)."""
    lines = [_f(r, s) for s in r.sample(ABOUT_AI, r.randint(3, 7))]
    if extra is not None:
        lines.insert(r.randint(1, len(lines)), extra)
    style = r.choice(["md", "plain", "html"])
    title = _f(r, r.choice(ABOUT_TITLES))
    if style == "html":
        return f"<article><h1>{title}</h1>\n" + "\n".join(f"<p>{s}</p>" for s in lines) + "\n</article>"
    if style == "md":
        return f"# {title}\n\n" + "\n".join(f"- {s}" for s in lines)
    return f"{title}\n\n" + " ".join(lines)


FORM_LINES = [
    "Fill in every field using a black pen.", "On the day, have your health card and a list of your medicines with you.",
    "Do not eat or drink anything after midnight before your procedure.", "Stop taking blood thinners 5 days before surgery unless told otherwise.",
    "Sign and date the declaration at the bottom of page {k}.", "Go through this leaflet before the first use of the kettle.",
    "WARNING: unplug the unit before cleaning. Never immerse the base in water.", "Store these pages somewhere safe; you may need them later.",
    "Return the completed form to HR by the {d}th.", "If you have a fever on the day, call us to rebook.",
    "Tick every box that applies to you.", "Attach a copy of your last payslip.", "Do not remove this label.",
    "Descale the machine every 3 months: fill the tank with descaler and run the rinse cycle twice.",
    "Emergency contact: name, relationship and phone number.", "Arrive 30 minutes early and report to reception on floor {k}.",
    "Caution: hot surfaces. Allow the appliance to cool before moving it.", "Answer every question; write N/A where a question does not apply.",
]
FORM_TITLES = ["NEW PATIENT INTAKE FORM", "Pre-operative instructions", "Employee onboarding checklist", "Safety instructions",
               "Expense claim form", "Quick start guide", "Tenancy application", "Visitor registration"]


def form(r: R, extra: str | None = None) -> str:
    """A form, a patient leaflet or an appliance manual: every order is for the reader."""
    lines = [_f(r, s) for s in r.sample(FORM_LINES, r.randint(4, 8))]
    if extra is not None:
        lines.insert(r.randint(1, len(lines)), extra)
    numbered = r.random() < 0.5
    body = "\n".join(f"{i}. {s}" if numbered else s for i, s in enumerate(lines, 1))
    fields = "\n".join(f"{name}: ____________" for name in r.sample(["Surname", "First name", "Date of birth", "Address",
                                                                      "Phone", "Signature", "Date"], r.randint(0, 4)))
    return f"{r.choice(FORM_TITLES)}\n\n{body}" + (f"\n\n{fields}" if fields else "")


BUSINESS = {
    "de": ["RECHNUNG Nr. {m}-{k}\nLeistungszeitraum: Oktober\nPosition 1: Wartung Heizungsanlage, {m},00 EUR\nZahlbar innerhalb von 14 Tagen ohne Abzug.",
           "Ihre Bestellung Nr. {m} wurde versandt. Sendungsverfolgung: DHL {m}{k}{n}. Bitte prüfen Sie die Ware bei Erhalt.",
           "Fehler 429: Zu viele Anfragen. Bitte versuchen Sie es in {k} Minuten erneut."],
    "fr": ["FACTURE n° {m}\nPrestation : nettoyage des bureaux\nMontant TTC : {m},00 €\nÀ régler par virement sous 30 jours.",
           "Votre commande n° {m} a été expédiée. Suivez votre colis avec le numéro {m}{k}{n}. Merci de votre confiance.",
           "Erreur 503 : service momentanément indisponible. Veuillez réessayer plus tard."],
    "es": ["FACTURA n.º {m}\nConcepto: mantenimiento mensual\nImporte: {m},00 €\nForma de pago: transferencia a 30 días.",
           "Tu pedido n.º {m} ya está en camino. Llegará entre el {d} y el {k} del mes. Conserva este correo como justificante.",
           "Error 401: credenciales no válidas. Comprueba tu clave de API e inténtalo de nuevo."],
    "pt": ["NOTA FISCAL n.º {m}\nServiço: manutenção de ar-condicionado\nValor: R$ {m},00\nVencimento em 15 dias.",
           "Seu pedido n.º {m} foi enviado. Código de rastreio: BR{m}{k}{n}. Confira o produto no ato da entrega.",
           "Erro 500: ocorreu um problema interno. Tente novamente em alguns minutos."],
    "it": ["FATTURA n. {m}\nDescrizione: assistenza tecnica\nTotale: {m},00 €\nPagamento a 30 giorni data fattura.",
           "Il tuo ordine n. {m} è stato spedito. Numero di tracciamento: {m}{k}{n}. Controlla il pacco alla consegna.",
           "Errore 404: risorsa non trovata. Verifica l'indirizzo e riprova."],
}


def foreign_business(r: R, lang: str | None = None, extra: str | None = None) -> str:
    """An invoice, a shipping notice or an error message in another language, sometimes as JSON."""
    lang = lang or r.choice(sorted(BUSINESS))
    text = _f(r, r.choice(BUSINESS[lang]))
    if extra is not None:
        lines = text.split("\n")
        lines.insert(r.randint(1, len(lines)), extra)
        text = "\n".join(lines)
    if r.random() < 0.3:
        head = json.dumps({"status": r.choice(["ok", "error"]), "lang": lang})[:-1] + ', "message": "'
        return head + text.replace('"', "'").replace("\n", " ") + '"}'
    return text


def _attack(r: R) -> str:
    return r.choice([lambda: _action(r), lambda: _ask(r), lambda: foreign_attack(r, r.choice(sorted(BUSINESS)))])()


def about_ai_injected(r: R) -> tuple[str, int, int]:
    """An instruction to the assistant reading it, planted in a document about AI assistants."""
    return planted(r, about_ai, _attack(r))


def form_or_business_injected(r: R) -> tuple[str, int, int]:
    """An instruction to the assistant in a form, a manual, or a business document in another language."""
    hosts: list[Callable[..., str]] = [form, foreign_business]
    return planted(r, r.choice(hosts), _attack(r))


FOURTH_BENIGN: dict[str, Callable[[R], str]] = {"c-about-ai": about_ai, "c-forms": form, "c-foreign-business": foreign_business}
FOURTH_INJECTED: dict[str, Callable[[R], tuple[str, int, int]]] = {"c-about-ai-injected": about_ai_injected,
                                                                    "c-forms-injected": form_or_business_injected}


def fourth_rows(n_per_kind: int = 60, seed: int = 1510) -> list[dict]:
    """The fourth round's rows, in the format of :func:`gate.train.contrast.rows`."""
    return _generated(FOURTH_BENIGN, FOURTH_INJECTED, n_per_kind, seed)
