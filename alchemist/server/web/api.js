// The API as both pages call it: the key kept in this browser, JSON calls with OpenAI-shaped errors, the SSE reader
// of /v1/chat/completions, and the settings panel in the bar.

const STORE = "alchemist.settings";
const DEFAULTS = { apiKey: "", adminKey: "", maxTokens: 256, temperature: 0.7 };

export function settings() {
  try {
    return { ...DEFAULTS, ...JSON.parse(localStorage.getItem(STORE) || "{}") };
  } catch {
    return { ...DEFAULTS };
  }
}

function save(changes) {
  localStorage.setItem(STORE, JSON.stringify({ ...settings(), ...changes }));
}

export class ApiError extends Error {
  constructor(status, message) {
    super(message);
    this.status = status;
  }
}

function headers(json, admin) {
  const s = settings();
  const key = (admin && s.adminKey) || s.apiKey;
  const h = json ? { "Content-Type": "application/json" } : {};
  if (key) h.Authorization = `Bearer ${key}`;
  return h;
}

async function failure(response) {
  const body = await response.json().catch(() => null);
  const message = body?.error?.message || `${response.status} ${response.statusText}`;
  if (response.status === 401 || response.status === 403) showKeyPrompt(message);
  return new ApiError(response.status, message);
}

export async function api(path, { method = "GET", body, admin = false } = {}) {
  const json = body !== undefined;
  const response = await fetch(path, { method, headers: headers(json, admin), body: json ? JSON.stringify(body) : undefined });
  if (!response.ok) throw await failure(response);
  return response.json();
}

// Yields the chunks of a streamed chat completion, as the server sends them.
export async function* streamChat(body) {
  const response = await fetch("/v1/chat/completions", {
    method: "POST", headers: headers(true), body: JSON.stringify({ ...body, stream: true }),
  });
  if (!response.ok) throw await failure(response);
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += value;
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      for (const line of event.split("\n")) {
        if (!line.startsWith("data: ")) continue;
        const data = line.slice(6);
        if (data === "[DONE]") return;
        const chunk = JSON.parse(data);
        if (chunk.error) throw new ApiError(500, chunk.error.message);
        yield chunk;
      }
    }
  }
}

export function notice(message) {
  document.getElementById("notice").textContent = message || "";
}

function showKeyPrompt(message) {
  notice(`${message} Enter an API key in Settings.`);
  const panel = document.getElementById("settings");
  panel.open = true;
  document.getElementById("api-key").focus();
}

let modelPromise = null;

// What the key may ask (GET /v1/models: the base model first, then the adapters it may name), shown in the bar: a
// choice on the chat page where there are several, the base model's name on the dashboard. Asked again after a
// failure (e.g. before a key was entered).
export function models() {
  modelPromise ??= api("/v1/models").then((list) => {
    const ids = list.data.map((card) => card.id);
    const el = document.getElementById("model");
    if (el.tagName === "SELECT") {
      const kept = el.value;
      el.replaceChildren(...ids.map((id) => new Option(id, id)));
      if (ids.includes(kept)) el.value = kept;
      el.disabled = ids.length < 2;
    } else {
      el.textContent = ids[0] || "";
    }
    return ids;
  });
  modelPromise.catch(() => { modelPromise = null; });
  return modelPromise;
}

// The model a new answer is asked of: the one chosen in the bar (the base model, or an adapter by its name).
export async function chosenModel() {
  const ids = await models();
  const el = document.getElementById("model");
  return (el.tagName === "SELECT" && el.value) || ids[0];
}

// The settings panel: every field is saved as it changes.
export function setupBar() {
  const s = settings();
  for (const input of document.querySelectorAll("#settings [data-setting]")) {
    const name = input.dataset.setting;
    input.value = s[name];
    input.addEventListener("change", () => {
      save({ [name]: input.type === "number" ? Number(input.value) : input.value });
      notice("");
    });
  }
  models().catch((e) => notice(e.message));
}
