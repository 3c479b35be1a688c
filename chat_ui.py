"""A Streamlit chat page for a running `nanovllm serve`, talking to it through the `openai` client.

    pip install "nanovllm[ui]"   # or: pip install streamlit openai
    nanovllm serve &              # the demo model, or: nanovllm serve /path/to/model &
    nanovllm ui                   # streamlit run chat_ui.py on loopback, no usage statistics

The sidebar sets the server URL, the model (empty: the server's own), temperature and max
tokens; the defaults come from NANOVLLM_BASE_URL, NANOVLLM_MODEL, NANOVLLM_API_KEY and
NANOVLLM_MAX_TOKENS. Answers
stream in as they are written; the conversation is kept until "Clear conversation". This page
knows only the HTTP API: it imports nothing of nanovllm (no torch), so it runs anywhere.
"""
import os

import openai
import streamlit as st

DEFAULT_BASE_URL = "http://127.0.0.1:8000/v1"  # `nanovllm serve`'s default address
DEFAULT_MAX_TOKENS = 256  # a few paragraphs
MAX_TOKENS_LIMIT = 2048  # the slider's end
# Seconds to wait for the server to answer "which models?"; it is local, so a short wait suffices.
STATUS_TIMEOUT = 3.0
# Seconds a whole answer may take: a long one on a CPU is slow.
ANSWER_TIMEOUT = 600.0


def _client(base_url: str, api_key: str, timeout: float) -> openai.OpenAI:
    # max_retries=0: a server that is down is reported at once, not after retries.
    return openai.OpenAI(base_url=base_url, api_key=api_key or "none", timeout=timeout, max_retries=0)


def _served_model(base_url: str, api_key: str) -> str | None:
    """The server's model name, or None (with the reason shown) when it cannot be reached."""
    try:
        models = _client(base_url, api_key, STATUS_TIMEOUT).models.list().data
    except openai.APIConnectionError:
        st.error(f"The server at {base_url} is down or unreachable. Start it with `nanovllm serve MODEL` "
                 "(or fix the Server URL in the sidebar), then press Retry.")
        st.button("Retry")
        return None
    except openai.APIStatusError as exc:
        st.error(f"The server at {base_url} refused: {exc.status_code} {exc.message}")
        return None
    return models[0].id if models else None


def main() -> None:
    st.set_page_config(page_title="nanovllm chat", page_icon="💬")
    st.title("nanovllm chat")
    messages: list[dict] = st.session_state.setdefault("messages", [])
    with st.sidebar:
        base_url = st.text_input("Server URL", os.environ.get("NANOVLLM_BASE_URL", DEFAULT_BASE_URL))
        model = st.text_input("Model", os.environ.get("NANOVLLM_MODEL", ""), help="empty: the server's model")
        api_key = st.text_input("API key", os.environ.get("NANOVLLM_API_KEY", ""), type="password")
        temperature = st.slider("Temperature", 0.0, 2.0, 0.7, 0.05)
        max_tokens = st.slider("Max tokens", 1, MAX_TOKENS_LIMIT,
                               int(os.environ.get("NANOVLLM_MAX_TOKENS", DEFAULT_MAX_TOKENS)))
        if st.button("Clear conversation"):
            messages.clear()

    served = _served_model(base_url, api_key)
    if served is not None:
        st.caption(f"{model or served} at {base_url}")
    for message in messages:
        with st.chat_message(message["role"]):
            st.markdown(message["content"])
    prompt = st.chat_input("Message", disabled=served is None)
    if not prompt:
        return
    with st.chat_message("user"):
        st.markdown(prompt)
    messages.append({"role": "user", "content": prompt})
    with st.chat_message("assistant"):
        try:
            stream = _client(base_url, api_key, ANSWER_TIMEOUT).chat.completions.create(
                model=model or served, messages=messages, temperature=temperature, max_tokens=max_tokens,
                stream=True)
            answer = st.write_stream(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
        except openai.APIConnectionError:
            messages.pop()  # not answered: the message can be sent again once the server is back
            st.error(f"The server at {base_url} went away before answering. Start it again, then resend.")
            return
        except openai.APIStatusError as exc:
            messages.pop()
            st.error(f"The server refused: {exc.status_code} {exc.message}")
            return
    messages.append({"role": "assistant", "content": answer if isinstance(answer, str) else "".join(answer)})


if __name__ == "__main__":
    main()
