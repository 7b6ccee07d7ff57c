// shoal's dashboard: a client of the same HTTP API the SDKs use, with the user's token.
"use strict";

const S = {token: sessionStorage.getItem("shoal.token") || "", auth: true, me: null, timers: [], term: null};
const $ = sel => document.querySelector(sel);
const main = () => $("#main");
const esc = s => String(s ?? "").replace(/[&<>"']/g, c => ({"&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;"}[c]));

// ---- API ------------------------------------------------------------------------------------------
class ApiError extends Error {
  constructor(status, body) {
    super((body && body.error && body.error.message) || `HTTP ${status}`);
    this.status = status; this.code = body && body.error && body.error.code;
  }
}

async function api(method, path, body) {
  const headers = {};
  if (S.token) headers["Authorization"] = "Bearer " + S.token;
  if (body !== undefined) headers["Content-Type"] = "application/json";
  const r = await fetch(path, {method, headers, body: body === undefined ? undefined : JSON.stringify(body)});
  if (r.status === 204) return null;
  const data = await r.json().catch(() => null);
  if (!r.ok) {
    if (r.status === 401 && S.auth) { S.token = ""; sessionStorage.removeItem("shoal.token"); showLogin(data); }
    throw new ApiError(r.status, data);
  }
  return data;
}
const get = (path, params) => api("GET", path + (params && params.toString() ? "?" + params : ""));

function toast(msg, err) {
  const t = $("#toast");
  t.textContent = msg; t.className = err ? "err" : ""; t.hidden = false;
  clearTimeout(toast.timer); toast.timer = setTimeout(() => { t.hidden = true; }, err ? 7000 : 3000);
}

function every(ms, fn) { fn(); S.timers.push(setInterval(fn, ms)); }
function clearPage() {
  S.timers.forEach(clearInterval); S.timers = [];
  if (S.term) { S.term.close(); S.term = null; }
}

// ---- formatting -------------------------------------------------------------------------------------
function age(t) {
  const s = Math.max(0, Date.now() / 1000 - t);
  if (s < 90) return s.toFixed(0) + "s";
  if (s < 5400) return (s / 60).toFixed(0) + "m";
  if (s < 172800) return (s / 3600).toFixed(1) + "h";
  return (s / 86400).toFixed(1) + "d";
}
const when = t => t ? new Date(t * 1000).toLocaleString() : "—";
const mb = v => v === null || v === undefined ? "—" : (v >= 10240 ? (v / 1024).toFixed(1) + " GiB" : Math.round(v) + " MiB");
const bytes = b => b >= 1 << 30 ? (b / 2 ** 30).toFixed(2) + " GiB" : b >= 1 << 20 ? (b / 2 ** 20).toFixed(1) + " MiB" : (b / 1024).toFixed(0) + " KiB";
const stateTag = s => `<span class="state ${esc(s)}">${esc(s)}</span>`;
const short = (d, n = 12) => esc(String(d).replace(/^sha256:/, "").slice(0, n));

// ---- login ------------------------------------------------------------------------------------------
function showLogin(err) {
  clearPage();
  $("#logout").hidden = true; $("#who").textContent = "";
  main().innerHTML = `<div class="panel login"><h1>Sign in</h1>
    <p class="muted">Paste an API token (<span class="mono">shoal token create --project NAME</span>).
    A project token sees its own sandboxes; an admin token sees everything.</p>
    <form id="loginform"><input id="token" type="password" autocomplete="off" placeholder="token" autofocus>
    <button class="primary" type="submit">Sign in</button></form>
    <p id="loginerr" class="muted">${err && err.error ? esc(err.error.message) : ""}</p></div>`;
  $("#loginform").onsubmit = async ev => {
    ev.preventDefault();
    S.token = $("#token").value.trim();
    try {
      await whoami();
      sessionStorage.setItem("shoal.token", S.token);
      route();
    } catch (e) { $("#loginerr").textContent = e.message; }
  };
}

async function whoami() {
  S.me = await api("GET", "/v1/ui/whoami");
  $("#who").textContent = S.me.admin ? `admin (${S.me.project})` : `project ${S.me.project}`;
  $("#logout").hidden = !S.auth;
}

// ---- overview ---------------------------------------------------------------------------------------
async function pageOverview() {
  main().innerHTML = `<h1>Overview</h1><div class="cards" id="cards"></div>
    <div id="nodeswrap"></div><div id="charts"></div>`;
  if (!S.me.admin) {
    $("#charts").innerHTML = `<p class="muted">Node figures and live charts are node-wide: they need an admin token.</p>`;
    every(5000, async () => {
      const p = await get("/v1/sandboxes/page", new URLSearchParams({limit: "1"}));
      const f = p.facets.state || {};
      $("#cards").innerHTML = card("sandboxes", p.total) + Object.entries(f).map(([k, v]) => card(k, v)).join("");
    });
    return;
  }
  $("#charts").innerHTML = `<h2>Live</h2><div class="grid">
    ${chartBox("rate", "Creates per second")}${chartBox("clat", "Create latency (ms)")}
    ${chartBox("elat", "Exec latency (ms)")}${chartBox("states", "Sandboxes by state")}
    ${chartBox("mem", "Memory, all nodes (MiB)")}${chartBox("nodemem", "Memory used per node (MiB)")}</div>`;
  let data = null;
  every(2000, async () => {
    const since = data && data.total.length ? data.total[data.total.length - 1].t : null;
    const [nodes, st] = await Promise.all([get("/v1/nodes"),
      get("/v1/stats", since ? new URLSearchParams({since}) : null)]);
    if (!data) data = st; else {
      data.total = data.total.concat(st.total).slice(-300);
      for (const [n, pts] of Object.entries(st.nodes)) data.nodes[n] = (data.nodes[n] || []).concat(pts).slice(-300);
    }
    renderNodes(nodes);
    renderCharts(data);
  });
}

const card = (k, v) => `<div class="panel card"><div class="k">${esc(k)}</div><div class="v">${esc(v)}</div></div>`;
const chartBox = (id, title) => `<div class="panel"><div>${esc(title)}</div><canvas class="chart" id="c-${id}"></canvas><div class="legend" id="l-${id}"></div></div>`;

function renderNodes(r) {
  const nodes = r.nodes;
  const tot = {running: 0, paused: 0, creating: 0};
  let used = 0, committed = 0, reclaimed = 0;
  for (const n of nodes) {
    for (const k of Object.keys(tot)) tot[k] += (n.sandboxes || {})[k] || 0;
    used += (n.memory || {}).used_mb || 0; committed += (n.memory || {}).committed_mb || 0;
    reclaimed += (n.memory || {}).reclaimed_mb || 0;
  }
  $("#cards").innerHTML = card("nodes", nodes.filter(n => n.health === "ok").length + " / " + nodes.length) +
    card("running", tot.running) + card("paused", tot.paused) + card("creating", tot.creating) +
    card("memory committed", mb(committed)) + card("memory used", mb(used)) + card("reclaimed", mb(reclaimed));
  $("#nodeswrap").innerHTML = `<h2>Nodes (${esc(r.kind)})</h2><table><thead><tr><th>node</th><th>health</th>
    <th>load</th><th>cpus</th><th>running</th><th>paused</th><th>committed</th><th>used</th><th>total</th>
    <th>backends</th></tr></thead><tbody>${nodes.map(n => `<tr><td class="mono">${esc(n.node_id)}</td>
    <td>${stateTag(n.health)}</td><td>${esc(n.load1 ?? "—")}</td><td>${esc(n.cpus ?? "—")}</td>
    <td>${esc((n.sandboxes || {}).running ?? 0)}</td><td>${esc((n.sandboxes || {}).paused ?? 0)}</td>
    <td>${mb((n.memory || {}).committed_mb)}</td><td>${mb((n.memory || {}).used_mb)}</td>
    <td>${mb((n.memory || {}).total_mb)}</td><td>${esc((n.backends || []).join(", "))}</td></tr>`).join("")}
    </tbody></table>`;
}

function renderCharts(d) {
  const pts = d.total;
  const ser = (name, key, src) => ({name, points: (src || pts).map(p => [p.t, p[key] ?? null])});
  const nested = (name, a, b) => ({name, points: pts.map(p => [p.t, (p[a] || {})[b] ?? null])});
  const draw = (id, series, opts) => { drawChart($("#c-" + id), series, opts); $("#l-" + id).innerHTML = legendHtml(series); };
  draw("rate", [ser("creates/s", "create_rate"), ser("execs/s", "exec_rate")]);
  draw("clat", [ser("p50", "create_p50"), ser("p90", "create_p90"), ser("p99", "create_p99")], {unit: ""});
  draw("elat", [ser("p50", "exec_p50"), ser("p90", "exec_p90"), ser("p99", "exec_p99")]);
  draw("states", [nested("running", "states", "running"), nested("paused", "states", "paused"),
    nested("creating", "states", "creating")]);
  draw("mem", [nested("committed", "memory", "committed_mb"), nested("used", "memory", "used_mb"),
    nested("reclaimed", "memory", "reclaimed_mb")]);
  draw("nodemem", Object.entries(d.nodes).map(([n, p]) => ({name: n, points: p.map(x => [x.t, (x.memory || {}).used_mb ?? null])})));
}

// ---- sandboxes ---------------------------------------------------------------------------------------
const FILTERS = ["project", "job", "label", "state", "backend", "image", "min_age_s", "max_age_s", "q"];

async function pageSandboxes(params) {
  const p = new URLSearchParams(params);
  const v = k => esc(p.get(k) || "");
  main().innerHTML = `<h1>Sandboxes</h1>
    <form class="filters" id="filters">
      ${S.me.admin ? `<label>project<input name="project" value="${v("project")}" size="10"></label>` : ""}
      <label>job<input name="job" value="${v("job")}" size="10"></label>
      <label>label<input name="label" value="${v("label")}" placeholder="key=value" size="14"></label>
      <label>state<select name="state">${["", "running", "paused", "creating", "failed", "lost"].map(s =>
        `<option ${p.get("state") === s ? "selected" : ""}>${s}</option>`).join("")}</select></label>
      <label>backend<select name="backend">${["", "container", "microvm", "vm", "fncall"].map(s =>
        `<option ${p.get("backend") === s ? "selected" : ""}>${s}</option>`).join("")}</select></label>
      <label>image<input name="image" value="${v("image")}" size="12"></label>
      <label>older than (s)<input name="min_age_s" value="${v("min_age_s")}" size="6"></label>
      <label>younger than (s)<input name="max_age_s" value="${v("max_age_s")}" size="6"></label>
      <label>id contains<input name="q" value="${v("q")}" size="12"></label>
      <button class="primary" type="submit">Filter</button><button type="button" id="clear">Clear</button>
    </form><div class="facet" id="facets"></div><div id="table"></div>
    <div class="pager"><button id="prev">‹ prev</button><span id="range" class="muted"></span>
    <button id="next">next ›</button><select id="limit">${[25, 50, 100, 200].map(n =>
      `<option ${String(n) === (p.get("limit") || "50") ? "selected" : ""}>${n}</option>`).join("")}</select></div>`;
  $("#filters").onsubmit = ev => {
    ev.preventDefault();
    const q = new URLSearchParams();
    for (const [k, val] of new FormData(ev.target)) if (String(val).trim()) q.set(k, String(val).trim());
    q.set("limit", $("#limit").value);
    location.hash = "#/sandboxes?" + q;
  };
  $("#clear").onclick = () => { location.hash = "#/sandboxes"; };
  const go = off => { p.set("offset", String(Math.max(0, off))); location.hash = "#/sandboxes?" + p; };
  $("#limit").onchange = () => { p.set("limit", $("#limit").value); go(0); };
  const offset = Number(p.get("offset") || 0), limit = Number(p.get("limit") || 50);
  $("#prev").onclick = () => go(offset - limit);
  $("#next").onclick = () => go(offset + limit);
  every(5000, async () => {
    const q = new URLSearchParams();
    for (const k of FILTERS) if (p.get(k)) q.set(k, p.get(k));
    q.set("offset", String(offset)); q.set("limit", String(limit));
    const t0 = performance.now();
    const r = await get("/v1/sandboxes/page", q);
    renderSandboxTable(r);
    window.shoalLastPageMs = performance.now() - t0;
  });
}

function renderSandboxTable(r) {
  const f = r.facets || {};
  $("#facets").innerHTML = `<b>${r.total}</b> match · ` + Object.entries(f.state || {}).map(([k, v]) => `${esc(k)} <b>${v}</b>`).join(" · ");
  $("#range").textContent = r.total ? `${r.offset + 1}–${Math.min(r.total, r.offset + r.items.length)} of ${r.total}` : "none";
  $("#prev").disabled = r.offset === 0;
  $("#next").disabled = r.offset + r.items.length >= r.total;
  $("#table").innerHTML = `<table id="sandboxes"><thead><tr><th>id</th><th>state</th><th>project</th><th>job</th>
    <th>image</th><th>backend</th><th>node</th><th>cpus</th><th>memory</th><th>age</th></tr></thead><tbody>
    ${r.items.map(s => `<tr class="row" data-id="${esc(s.id)}"><td class="mono">${esc(s.id)}</td><td>${stateTag(s.state)}</td>
    <td>${esc(s.project)}</td><td>${esc(s.job || "")}</td><td>${esc(s.image)}</td><td>${esc(s.backend)}</td>
    <td class="mono">${esc(s.node)}</td><td>${esc(s.cpus ?? "")}</td><td>${mb(s.memory_mb)}</td><td>${age(s.created_at)}</td></tr>`).join("")}
    </tbody></table>`;
  for (const tr of document.querySelectorAll("tr.row")) tr.onclick = () => { location.hash = "#/sandbox/" + tr.dataset.id; };
}

// ---- one sandbox --------------------------------------------------------------------------------------
async function pageSandbox(id) {
  main().innerHTML = `<p class="muted">loading ${esc(id)}…</p>`;
  let info;
  try { info = await get("/v1/sandboxes/" + encodeURIComponent(id)); } catch (e) {
    if (e.status !== 404) throw e;
    info = null;
  }
  const spec = (info && info.spec) || {};
  const live = info && !["stopped", "lost"].includes(info.state);
  main().innerHTML = `<h1 class="mono">${esc(id)} ${info ? stateTag(info.state) : stateTag("closed")}</h1>
    ${live ? `<div class="actions">
      <button id="a-pause" ${info.state !== "running" ? "disabled" : ""}>Pause</button>
      <button id="a-resume" ${info.state !== "paused" ? "disabled" : ""}>Resume</button>
      <button id="a-snap">Snapshot…</button>
      <button id="a-term" class="primary">Open terminal</button>
      <button id="a-close" class="danger">Close</button></div>` : `<p class="muted">This sandbox no longer exists; its events remain.</p>`}
    <div id="termwrap"></div>
    <div class="cols2">
      <div class="panel"><h2>Sandbox</h2><div class="kv">${info ? kv({
        image: info.image, backend: info.backend, runtime: info.runtime, node: info.node, project: spec.project,
        created: when(info.created_at) + ` (${age(info.created_at)} ago)`, expires: when(info.expires_at),
        labels: Object.entries(info.labels || {}).map(([k, v]) => `${k}=${v}`).join(", ") || "—",
        paused_by: (info.extra || {}).paused_by}) : ""}</div></div>
      <div class="panel"><h2>Limits and usage</h2><div class="kv" id="usage">${info ? kv({
        cpus: spec.cpus, memory: mb(spec.memory_mb), disk: spec.disk_mb ? mb(spec.disk_mb) : "—",
        network: JSON.stringify(spec.network), "ttl (s)": spec.ttl_s, "max output": spec.max_output_bytes ? bytes(spec.max_output_bytes) : "—"}) : ""}</div></div>
    </div>
    <h2>Recent commands</h2><div id="commands"></div>
    <h2>Events</h2><div id="events"></div>
    ${info ? `<h2>Spec</h2><pre class="panel mono">${esc(JSON.stringify(spec, null, 2))}</pre>` : ""}`;
  if (live) wireActions(id, info);
  every(3000, async () => {
    const enc = encodeURIComponent(id);
    const [ev, cmd, use] = await Promise.all([
      get(`/v1/sandboxes/${enc}/events`), get(`/v1/sandboxes/${enc}/events`, new URLSearchParams({commands: "true"})),
      live ? get(`/v1/sandboxes/${enc}/usage`).catch(() => null) : null]);
    $("#events").innerHTML = eventTable(ev.events, false);
    $("#commands").innerHTML = commandTable(cmd.events);
    if (use && $("#usage")) {
      $("#usage").innerHTML = kv({cpus: spec.cpus, "memory limit": mb(spec.memory_mb),
        "memory used": mb(use.memory_mb), "working set": mb(use.working_set_mb), "cpu time (s)": use.cpu_s,
        processes: use.pids, "oom kills": use.oom_kills, reclaimed: use.reclaimed_mb !== undefined ? mb(use.reclaimed_mb) : undefined,
        disk: spec.disk_mb ? mb(spec.disk_mb) : "—", network: JSON.stringify(spec.network), "ttl (s)": spec.ttl_s});
    }
  });
}

function kv(o) {
  return Object.entries(o).filter(([, v]) => v !== undefined && v !== null && v !== "")
    .map(([k, v]) => `<div class="k">${esc(k)}</div><div>${esc(v)}</div>`).join("");
}

function eventTable(evs, withId) {
  if (!evs.length) return `<p class="muted">none</p>`;
  return `<table class="events"><thead><tr><th>time</th>${withId ? "<th>sandbox</th><th>project</th>" : ""}<th>event</th><th>details</th></tr></thead><tbody>
    ${evs.slice().reverse().map(e => {
      const d = Object.entries(e).filter(([k]) => !["t", "kind", "id", "project", "node"].includes(k) && e[k] !== null)
        .map(([k, v]) => `${k}=${typeof v === "object" ? JSON.stringify(v) : v}`).join(" ");
      return `<tr><td>${esc(when(e.t))}</td>${withId ? `<td class="mono"><a href="#/sandbox/${esc(e.id)}">${esc(e.id)}</a></td><td>${esc(e.project)}</td>` : ""}
      <td>${stateTag(e.kind)}</td><td class="mono">${esc(d)}</td></tr>`;
    }).join("")}</tbody></table>`;
}

function commandTable(cmds) {
  if (!cmds.length) return `<p class="muted">none yet</p>`;
  return `<table class="commands"><thead><tr><th>time</th><th>command</th><th>exit</th><th>duration</th><th>via</th></tr></thead><tbody>
    ${cmds.slice().reverse().map(c => `<tr><td>${esc(when(c.t))}</td><td class="mono">${esc(c.cmd)}</td>
    <td>${c.timed_out ? stateTag("timeout") : esc(c.exit_code)}</td><td>${esc((c.duration_s * 1000).toFixed(1))} ms</td>
    <td>${esc(c.via)}</td></tr>`).join("")}</tbody></table>`;
}

function wireActions(id, info) {
  const enc = encodeURIComponent(id);
  const act = async (label, fn, reload = true) => {
    try {
      await fn(); toast(label + " done");
      if (reload) { clearPage(); await pageSandbox(id); }
    } catch (e) { toast(e.message, true); }
  };
  $("#a-pause").onclick = () => confirm(`Pause ${id}? Its processes freeze and its memory is reclaimed.`) &&
    act("pause", () => api("POST", `/v1/sandboxes/${enc}/pause`));
  $("#a-resume").onclick = () => confirm(`Resume ${id}?`) && act("resume", () => api("POST", `/v1/sandboxes/${enc}/resume`));
  $("#a-snap").onclick = () => {
    const name = prompt(`Snapshot ${id} into a new image named:`, "snap-" + id.slice(-6) + ":1");
    if (name) act("snapshot", async () => { const r = await api("POST", `/v1/sandboxes/${enc}/snapshot`, {name}); toast("image " + (r.ref || r.name)); });
  };
  $("#a-close").onclick = () => confirm(`Close ${id}? It is destroyed with everything in it.`) &&
    act("close", async () => { await api("DELETE", `/v1/sandboxes/${enc}`); location.hash = "#/sandboxes"; }, false);
  $("#a-term").onclick = () => openTerminal(id);
}

// ---- terminal: the API's PTY stream over WebSocket ------------------------------------------------
async function openTerminal(id) {
  if (S.term) S.term.close();
  $("#termwrap").innerHTML = `<h2>Terminal</h2><div class="term" id="term"></div>`;
  const term = new Terminal({fontSize: 13, cursorBlink: true, convertEol: false,
    fontFamily: "ui-monospace, SFMono-Regular, Menlo, Consolas, monospace"});
  const fit = new FitAddon.FitAddon();
  term.loadAddon(fit);
  term.open($("#term"));
  fit.fit();
  const {ticket} = await api("POST", "/v1/ui/ticket");
  const proto = location.protocol === "https:" ? "wss:" : "ws:";
  const ws = new WebSocket(`${proto}//${location.host}/v1/sandboxes/${encodeURIComponent(id)}/stream?ticket=${encodeURIComponent(ticket)}`);
  ws.binaryType = "arraybuffer";
  const enc = new TextEncoder();
  const resize = () => { if (ws.readyState === 1) ws.send(JSON.stringify({type: "resize", rows: term.rows, cols: term.cols})); };
  ws.onopen = () => ws.send(JSON.stringify({
    cmd: ["/bin/sh", "-c", "if command -v bash >/dev/null; then exec bash -l; else exec sh -l; fi"],
    tty: true, stdin: true, timeout: null, env: {TERM: "xterm-256color"}}));
  ws.onmessage = m => {
    if (typeof m.data === "string") {
      const msg = JSON.parse(m.data);
      if (msg.type === "started") { resize(); term.focus(); }
      else if (msg.type === "exit") term.write(`\r\n[exited with ${msg.result.exit_code}]\r\n`);
      else if (msg.type === "error") term.write(`\r\n[error: ${msg.error.message}]\r\n`);
      return;
    }
    term.write(new Uint8Array(m.data, 1));
  };
  ws.onclose = () => term.write("\r\n[disconnected]\r\n");
  term.onData(d => { if (ws.readyState === 1) ws.send(enc.encode(d)); });
  term.onResize(resize);
  const onWin = () => fit.fit();
  window.addEventListener("resize", onWin);
  window.shoalTerm = term;
  S.term = {close: () => { window.removeEventListener("resize", onWin); try { ws.close(); } catch (e) { /* gone */ } term.dispose(); }};
}

// ---- images -----------------------------------------------------------------------------------------
async function pageImages() {
  main().innerHTML = `<h1>Images</h1><div id="imgs"><p class="muted">loading…</p></div>`;
  const [imgs, users] = await Promise.all([get("/v1/images"), get("/v1/ui/image-users")]);
  const rows = imgs.images.slice().sort((a, b) => (users.images[b.name + ":" + b.tag] || 0) - (users.images[a.name + ":" + a.tag] || 0));
  $("#imgs").innerHTML = `<table id="images"><thead><tr><th>image</th><th>size</th><th>layers</th><th>sandboxes using it</th><th>created</th></tr></thead><tbody>
    ${rows.map(i => {
      const ref = i.tag ? `${i.name}:${i.tag}` : i.name;
      return `<tr class="img" data-ref="${esc(ref)}"><td class="mono">${esc(ref)}</td><td>${bytes(i.size)}</td>
        <td>${i.layers.length}</td><td>${users.images[ref] || 0}</td><td>${esc(when(i.created))}</td></tr>
        <tr class="layers" hidden><td colspan="5"><table><thead><tr><th>layer</th><th>size</th><th>sandboxes using it</th></tr></thead><tbody>
        ${i.layers.map((d, k) => `<tr><td class="mono">${short(d, 16)}</td><td>${users.sizes[d] !== undefined ? bytes(users.sizes[d]) : "—"}</td>
        <td>${users.layers[String(d).replace(/^sha256:/, "")] || 0}</td></tr>`).join("")}</tbody></table></td></tr>`;
    }).join("")}</tbody></table><p class="muted">Click an image for its layers (bottom first).</p>`;
  for (const tr of document.querySelectorAll("tr.img")) tr.onclick = () => { tr.nextElementSibling.hidden = !tr.nextElementSibling.hidden; };
}

// ---- events -----------------------------------------------------------------------------------------
async function pageEvents(params) {
  const p = new URLSearchParams(params);
  main().innerHTML = `<h1>Events</h1><form class="filters" id="evf"><label>kind<select name="kind">
    ${["", "created", "paused", "resumed", "oom", "timeout", "lost", "closed"].map(k => `<option ${p.get("kind") === k ? "selected" : ""}>${k}</option>`).join("")}
    </select></label><button class="primary">Show</button></form><div id="evs"></div>`;
  $("#evf").onsubmit = ev => { ev.preventDefault(); const k = new FormData(ev.target).get("kind"); location.hash = "#/events" + (k ? "?kind=" + k : ""); };
  every(3000, async () => {
    const q = new URLSearchParams({limit: "300"});
    if (p.get("kind")) q.set("kind", p.get("kind"));
    const r = await get("/v1/events", q);
    $("#evs").innerHTML = eventTable(r.events, true);
  });
}

// ---- routing ----------------------------------------------------------------------------------------
async function route() {
  clearPage();
  const [path, query] = (location.hash.slice(1) || "/overview").split("?");
  const parts = path.split("/").filter(Boolean);
  for (const a of document.querySelectorAll("nav a")) a.classList.toggle("active", a.dataset.nav === (parts[0] === "sandbox" ? "sandboxes" : parts[0]));
  try {
    if (!S.me) await whoami();
    if (parts[0] === "sandboxes") await pageSandboxes(query || "");
    else if (parts[0] === "sandbox") await pageSandbox(decodeURIComponent(parts[1] || ""));
    else if (parts[0] === "images") await pageImages();
    else if (parts[0] === "events") await pageEvents(query || "");
    else await pageOverview();
  } catch (e) {
    if (e.status === 401) return;
    main().innerHTML = `<p class="muted">${esc(e.message)}</p>`;
  }
}

async function boot() {
  $("#logout").onclick = () => { sessionStorage.removeItem("shoal.token"); S.token = ""; S.me = null; showLogin(); };
  window.addEventListener("unhandledrejection", ev => { if (ev.reason instanceof ApiError && ev.reason.status !== 401) toast(ev.reason.message, true); });
  const h = await fetch("/healthz").then(r => r.json()).catch(() => ({auth: true}));
  S.auth = !!h.auth;
  window.addEventListener("hashchange", route);
  if (S.auth && !S.token) return showLogin();
  route();
}
boot();
