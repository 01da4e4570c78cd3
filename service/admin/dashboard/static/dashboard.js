// tabloop operations dashboard. Plain JS, no build step; charts by uPlot (vendor/uplot).
// The admin key lives in sessionStorage (this tab only) and goes out as a Bearer token.
(() => {
  "use strict";

  const KEY = "tabloop.adminKey";
  const WINDOW = "tabloop.window";
  const REFRESH_MS = 5000;
  const AUDIT_ROWS = 20;
  const PALETTE = ["#2f6fde", "#e8833a", "#1f8a4c", "#a04fc6", "#c8363d", "#2a9d9f",
                   "#8c6d31", "#d4568f"];
  const ACTION_COLORS = { deploy: "#b7791f", promote: "#1f8a4c", rollback: "#c8363d",
                          bootstrap: "#2f6fde" };
  // what people keep leads: kept characters per 100 requests (accepted x retained)
  const CHARTS = [
    { id: "kept", field: "kept_chars_per_100", fmt: (v) => num(v, 1), zero: true },
    { id: "accept", field: "accept_rate", fmt: pct, zero: true },
    { id: "shown", field: "shown_rate", fmt: pct, zero: true },
    { id: "reward", field: "mean_reward", fmt: (v) => num(v, 3), zero: false },
  ];

  const $ = (id) => document.getElementById(id);
  // Exposed for the browser test and for poking at in the console.
  const state = { charts: {}, chartVersions: {}, deployments: [], current: null, training: null,
                  metrics: null, audit: [], timer: null, busy: false, gen: 0 };
  window.tabloopDashboard = state;

  // --- formatting --------------------------------------------------------------------------
  function pct(v) { return v == null ? "–" : (100 * v).toFixed(1) + "%"; }
  function num(v, digits) { return v == null ? "–" : Number(v).toFixed(digits); }
  function int(v) { return v == null ? "–" : Number(v).toLocaleString(); }
  function color(version) { return PALETTE[(version - 1) % PALETTE.length]; }
  function when(iso) {
    if (!iso) return "–";
    const d = new Date(iso);
    const sameDay = d.toDateString() === new Date().toDateString();
    return sameDay ? d.toLocaleTimeString() : d.toLocaleString();
  }
  function ago(iso) {
    if (!iso) return "never";
    const s = Math.max(0, (Date.now() - Date.parse(iso)) / 1000);
    if (s < 90) return `${Math.round(s)} s ago`;
    if (s < 5400) return `${Math.round(s / 60)} min ago`;
    return `${(s / 3600).toFixed(1)} h ago`;
  }
  function seconds(s) {
    if (s == null) return "–";
    return s < 120 ? `${num(s, 1)} s` : `${num(s / 60, 1)} min`;
  }
  function el(tag, attrs, ...children) {
    const node = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) {
      if (k === "class") node.className = v;
      else if (k === "style") node.setAttribute("style", v);
      else node.setAttribute(k, v);
    }
    for (const c of children) if (c != null) node.append(c);
    return node;
  }

  // --- API -----------------------------------------------------------------------------------
  class ApiError extends Error {
    constructor(status, message) { super(message); this.status = status; }
  }

  async function api(method, path, body) {
    const headers = { Authorization: `Bearer ${sessionStorage.getItem(KEY) || ""}` };
    if (body !== undefined) headers["Content-Type"] = "application/json";
    let res;
    try {
      res = await fetch(path, { method, headers,
                                body: body === undefined ? undefined : JSON.stringify(body) });
    } catch (e) {
      throw new ApiError(0, `the service is unreachable (${e.message})`);
    }
    let data = null;
    try { data = await res.json(); } catch (_) { /* not JSON: use the status text */ }
    if (!res.ok) {
      const msg = data && data.error ? data.error.message : res.statusText;
      throw new ApiError(res.status, `${msg} (HTTP ${res.status})`);
    }
    return data;
  }

  function authMessage(e) {
    if (e.status === 401) return "That key was not accepted: unknown or revoked (401).";
    if (e.status === 403) return "That key lacks the admin scope (403).";
    return null;
  }

  // --- views ---------------------------------------------------------------------------------
  function showLogin(message) {
    clearInterval(state.timer);
    state.timer = null;
    $("app").hidden = true;
    $("login").hidden = false;
    $("login-error").hidden = !message;
    $("login-error").textContent = message || "";
    $("key-input").value = "";
    $("key-input").focus();
  }

  function showApp() {
    $("login").hidden = true;
    $("app").hidden = false;
    refresh();
    clearInterval(state.timer);
    state.timer = setInterval(refresh, REFRESH_MS);
  }

  function banner(message, kind) {
    const b = $("banner");
    b.hidden = !message;
    b.textContent = message || "";
    b.className = "banner" + (kind ? " " + kind : "");
  }

  function fail(e, what) {
    const auth = authMessage(e);
    if (auth) {
      sessionStorage.removeItem(KEY);
      showLogin(auth + " Sign in again.");
      return;
    }
    banner(`${what}: ${e.message}`);
  }

  // --- refresh -------------------------------------------------------------------------------
  async function refresh(force) {
    if (state.busy && !force) return;  // the timer skips a beat while the service is slow
    state.busy = true;
    const gen = ++state.gen;  // only the latest refresh renders (an action's beats the timer's)
    const win = $("window-select").value;
    try {
      const [metrics, deployments, training, audit, keys, spec] = await Promise.all([
        api("GET", `/admin/metrics?window=${encodeURIComponent(win)}`),
        api("GET", "/admin/deployments?limit=50"),
        api("GET", "/admin/training"),
        api("GET", `/admin/audit?limit=${AUDIT_ROWS}`),
        api("GET", "/admin/keys"),
        api("GET", "/admin/reward-spec"),
      ]);
      if (gen !== state.gen) return;
      state.metrics = metrics;
      state.deployments = deployments;
      state.current = deployments[0] || null;
      state.training = training;
      state.audit = audit.entries;
      renderRouting();
      renderVersions(metrics);
      renderCharts(metrics);
      renderFeedback(metrics.feedback);
      renderTimeline(deployments);
      renderTrainer(training);
      renderThresholds(spec);
      renderAudit(audit.entries);
      renderKeys(keys);
      if (!$("banner").classList.contains("info")) banner(null);
      $("updated").textContent = "updated " + new Date().toLocaleTimeString();
    } catch (e) {
      if (gen === state.gen) fail(e, "Refresh failed");
    } finally {
      if (gen === state.gen) state.busy = false;
    }
  }

  function renderRouting() {
    const d = state.current;
    const t = state.training;
    const pills = [];
    if (d) {
      pills.push(el("span", { class: "pill live" }, `live v${d.live_version}`));
      if (d.canary_version != null) {
        pills.push(el("span", { class: "pill canary" },
                      `canary v${d.canary_version} · ${pct(d.canary_fraction)}`));
      }
    } else {
      pills.push(el("span", { class: "pill bad" }, "nothing deployed"));
    }
    if (t) {
      const s = t.paused ? "paused" : (t.trainer.state || "unknown");
      const cls = t.paused ? "pill canary" : (t.alive ? "pill" : "pill bad");
      pills.push(el("span", { class: cls }, `trainer ${t.alive ? s : "offline"}`));
    }
    $("routing").replaceChildren(...pills);

    const promote = $("promote");
    promote.disabled = !(d && d.canary_version != null);
    promote.textContent = d && d.canary_version != null
      ? `Promote canary v${d.canary_version}` : "Promote canary";
    const rollback = $("rollback");
    rollback.disabled = !d;
    rollback.title = d && d.canary_version != null
      ? `Withdraw canary v${d.canary_version}; live stays v${d.live_version}`
      : "Put the previous live version back";
  }

  function renderVersions(m) {
    $("versions-window").textContent =
      `${when(m.from)} – ${when(m.to)} · buckets of ${m.bucket_s} s`;
    const rows = m.versions.slice().reverse().map((v) => el("tr", { "data-version": v.policy_version },
      el("td", {}, el("span", { class: "swatch", style: `background:${color(v.policy_version)}` }),
         `v${v.policy_version}`),
      el("td", { class: "headline" }, num(v.kept_chars_per_100, 1)),
      el("td", {}, pct(v.accept_rate)),
      el("td", {}, num(v.not_taken_per_request, 3)),
      el("td", {}, int(v.suggestions)),
      el("td", {}, pct(v.shown_rate)),
      el("td", {}, pct(v.retained_fraction)),
      el("td", {}, num(v.mean_reward, 3)),
      el("td", {}, int(v.rewards_finalized)),
      el("td", {}, `${num(v.latency_ms_p50, 1)} / ${num(v.latency_ms_p99, 1)} ms`),
    ));
    if (!rows.length) {
      rows.push(el("tr", {}, el("td", { class: "empty", colspan: "10" },
                                "No rollouts in this window yet.")));
    }
    $("versions-table").tBodies[0].replaceChildren(...rows);
  }

  // --- charts --------------------------------------------------------------------------------
  function chartData(m, field) {
    // every bucket of the window on the x axis (aligned like the API's), one series per version
    const step = m.bucket_s;
    const from = Date.parse(m.from) / 1000;
    const to = Date.parse(m.to) / 1000;
    const xs = [];
    for (let t = Math.floor(from / step) * step; t < to; t += step) xs.push(t);
    const index = new Map(xs.map((t, i) => [t, i]));
    const versions = m.versions.map((v) => v.policy_version);
    const series = versions.map(() => xs.map(() => null));
    for (const b of m.buckets) {
      const i = index.get(Date.parse(b.start) / 1000);
      const s = versions.indexOf(b.policy_version);
      if (i !== undefined && s >= 0) series[s][i] = b[field];
    }
    return { versions, data: [xs, ...series] };
  }

  function drawDeployments(u) {
    const ctx = u.ctx;
    const { top, height } = u.bbox;
    const dpr = window.devicePixelRatio || 1;
    ctx.save();
    ctx.lineWidth = dpr;
    ctx.setLineDash([4 * dpr, 4 * dpr]);
    for (const d of state.deployments) {
      const t = Date.parse(d.created_at) / 1000;
      if (t < u.scales.x.min || t > u.scales.x.max) continue;
      const x = Math.round(u.valToPos(t, "x", true));
      ctx.strokeStyle = ACTION_COLORS[d.action] || "#999";
      ctx.beginPath();
      ctx.moveTo(x, top);
      ctx.lineTo(x, top + height);
      ctx.stroke();
    }
    ctx.restore();
  }

  function chartOptions(spec, versions, width) {
    const axis = { stroke: "#6b7585", grid: { stroke: "#eef1f5" }, ticks: { stroke: "#e2e6ec" } };
    return {
      width, height: 220,
      scales: {
        x: { time: true },
        y: { range: (u, min, max) => {
          const lo = spec.zero ? Math.min(0, min) : min;
          const hi = max > lo ? max : lo + 1;
          return [lo, hi + (hi - lo) * 0.08];
        } },
      },
      axes: [axis, { ...axis, size: 64, values: (u, vals) => vals.map(spec.fmt) }],
      series: [{}, ...versions.map((v) => ({
        label: `v${v}`, stroke: color(v), width: 2, spanGaps: true,
        points: { size: 5, fill: color(v) },
        value: (u, val) => spec.fmt(val),
      }))],
      hooks: { draw: [drawDeployments] },
    };
  }

  function renderCharts(m) {
    for (const spec of CHARTS) {
      const box = $(`chart-${spec.id}`);
      const { versions, data } = chartData(m, spec.field);
      const hasData = data.slice(1).some((s) => s.some((v) => v != null));
      let chart = state.charts[spec.id];
      if (!hasData) {
        if (chart) chart.destroy();
        delete state.charts[spec.id];
        box.replaceChildren(el("div", { class: "empty" }, "No data in this window yet."));
        continue;
      }
      const key = versions.join(",");
      if (chart && state.chartVersions[spec.id] === key) {
        chart.setData(data);
        continue;
      }
      if (chart) chart.destroy();
      box.replaceChildren();
      chart = new uPlot(chartOptions(spec, versions, box.clientWidth || 500), data, box);
      state.charts[spec.id] = chart;
      state.chartVersions[spec.id] = key;
    }
  }

  window.addEventListener("resize", () => {
    for (const [id, chart] of Object.entries(state.charts)) {
      chart.setSize({ width: $(`chart-${id}`).clientWidth, height: 220 });
    }
  });

  // --- feedback trust: refused events and capped training weight, per person and key ---------
  function who(kind, g) {
    const label = kind === "key" ? `key ${g.name || g.id}` : g.id;
    return el("td", { title: kind === "key" ? `API key ${g.id}` : `user_id ${g.id}` }, label);
  }

  function trustRows(f, field, cells, empty, colspan) {
    const groups = [...f[`${field}_users`].map((g) => ["user", g]),
                    ...f[`${field}_keys`].map((g) => ["key", g])];
    const rows = groups.map(([kind, g]) => el("tr", { "data-kind": kind, "data-id": g.id },
                                              who(kind, g), ...cells(g)));
    if (!rows.length) {
      rows.push(el("tr", {}, el("td", { class: "empty", colspan }, empty)));
    }
    return rows;
  }

  function renderFeedback(f) {
    if (!f) return;
    $("feedback-window").textContent =
      `${$("window-select").selectedOptions[0].textContent} · the most first`;
    const reasons = (r) => Object.entries(r).map(([k, v]) => `${k} ${int(v)}`).join(", ");
    $("refused-total").textContent = `${int(f.refused)} events`;
    $("refused-table").tBodies[0].replaceChildren(...trustRows(f, "refused",
      (g) => [el("td", {}, int(g.refused)), el("td", { class: "muted" }, reasons(g.reasons))],
      "No feedback refused.", "3"));
    $("capped-total").textContent = `${int(f.batches)} batches`;
    $("capped-table").tBodies[0].replaceChildren(...trustRows(f, "capped",
      (g) => [el("td", {}, int(g.batches)), el("td", {}, num(g.weight_removed, 1)),
              el("td", {}, pct(g.max_share))],
      "Nobody capped.", "4"));
  }

  // --- deployments and trainer ---------------------------------------------------------------
  function describe(d) {
    switch (d.action) {
      case "bootstrap": return `v${d.live_version} live (base policy)`;
      case "deploy":
        return d.canary_version == null
          ? `v${d.live_version} deployed live`
          : `canary v${d.canary_version} to ${pct(d.canary_fraction)} of users (live v${d.live_version})`;
      case "promote": return `v${d.live_version} promoted to live`;
      case "rollback": return `rolled back: live v${d.live_version}, no canary`;
      default: return `${d.action}: live v${d.live_version}`;
    }
  }

  function renderTimeline(deployments) {
    const items = deployments.map((d) => el("li", { "data-action": d.action, "data-id": d.id },
      el("span", { class: `badge ${d.action}` }, d.action),
      el("span", { class: "what" }, describe(d)),
      el("time", { datetime: d.created_at, title: d.created_at }, when(d.created_at)),
      d.reason ? el("span", { class: "reason" }, d.reason) : null,
    ));
    if (!items.length) items.push(el("li", {}, el("span", { class: "muted" }, "No deployments.")));
    $("timeline").replaceChildren(...items);
  }

  function renderTrainer(t) {
    const info = t.trainer || {};
    const gate = info.last_gate;
    // full mode: the join's consumer-group members, each with its partitions' pending rollouts
    const members = t.members || [];
    const pending = members.length ? members.reduce((n, m) => n + (m.pending || 0), 0)
                                   : info.pending;
    const facts = [
      ["state", t.paused ? "paused" : (info.state || "–")],
      ["heartbeat", t.alive ? ago(t.heartbeat_at) : `offline (last ${ago(t.heartbeat_at)})`],
      ["join lag", seconds(info.join_lag_s)],
      ["pending rollouts", int(pending)],
      // only rewards whose rollouts are past the reward horizon (all of their time's feedback
      // is in) fill a batch, so this trails "rewards not yet trained on" by the horizon
      ["batch fill (past the horizon)", info.batch_size
        ? `${int(info.batch_fill)} / ${int(info.batch_size)}` : int(info.batch_fill)],
      ["rewards finalized", int(t.rewards_finalized)],
      ["rewards not yet trained on", int(t.rewards_untrained)],
      ["late events", int(t.late_events)],
      ["last update", info.last_update ? ago(info.last_update.at) : "none yet"],
      ["last deploy check", gate ? `${gate.passed ? "passed" : "failed"}: ${gate.reason}` : "none yet"],
      // what people would keep from the candidate (estimated off-policy) against live
      ["kept chars / request", gate && gate.kept_live != null
        ? `candidate ${num(gate.kept_candidate_est, 2)} vs live ${num(gate.kept_live, 2)} `
          + `(s.e. ${num(gate.kept_se, 2)})` : "–"],
    ];
    if (members.length) {
      facts.push(["join members", members.map((m) => `${m.member}${m.leader ? " (leads)" : ""}: `
        + `partitions ${(m.partitions || []).join(",") || "none"}, ${int(m.pending)} pending`)
        .join("; ")]);
    }
    $("trainer").replaceChildren(...facts.flatMap(([k, v]) => [el("dt", {}, k), el("dd", {}, v)]));
    $("pause").hidden = t.paused;
    $("resume").hidden = !t.paused;
  }

  // the show thresholds the reward spec implies (docs/REWARD.md, Break-even accept rates)
  function renderThresholds(spec) {
    $("spec-version").textContent = `reward spec v${spec.version}`;
    const need = (p) => (p == null ? "never" : pct(p));
    $("thresholds-table").tBodies[0].replaceChildren(...spec.thresholds.map((t) =>
      el("tr", { "data-chars": String(t.chars) },
        el("td", {}, int(t.chars)), el("td", {}, need(t.kept)), el("td", {}, need(t.no_report)))));
  }

  // --- keys ----------------------------------------------------------------------------------
  function renderKeys(keys) {
    const rows = keys.map((k) => el("tr", { "data-key": k.id },
      el("td", { class: "mono" }, k.id),
      el("td", {}, k.name),
      el("td", {}, k.scopes.join(", ")),
      el("td", { class: "workspace" }, k.workspace === k.id ? `${k.workspace} (its own)` : k.workspace),
      el("td", {}, k.no_train ? "no-train" : "–"),
      el("td", {}, k.revoked_at ? `revoked ${when(k.revoked_at)}` : "active")));
    $("keys-table").tBodies[0].replaceChildren(...rows);
  }

  // --- audit log -----------------------------------------------------------------------------
  function auditDetail(e) {
    const d = e.detail || {};
    if (d.error) return d.error.message;
    if (d.reason) return d.reason;
    if (d.canary_fraction != null) return `${pct(d.canary_fraction)} of users`;
    if (d.changed) return Object.entries(d.changed).map(([k, v]) => `${k} = ${JSON.stringify(v)}`)
      .join(", ");
    if (d.removed) return Object.entries(d.removed).map(([k, v]) => `${v} ${k}`).join(", ");
    if (d.name) return `${d.name} (${(d.scopes || []).join(", ")})`;
    return "";
  }

  function renderAudit(entries) {
    const rows = entries.map((e) => el("tr", { "data-id": e.id, "data-action": e.action,
                                              "data-outcome": e.outcome },
      el("td", {}, el("time", { datetime: e.at, title: e.at }, when(e.at))),
      el("td", { title: e.key_id ? `key ${e.key_id}` : "no key" }, e.key_name || "–"),
      el("td", {}, e.action),
      el("td", {}, e.target == null ? "–" : e.target),
      el("td", {}, el("span", { class: `outcome ${e.outcome === "ok" ? "ok" : "refused"}` },
                      e.outcome === "ok" ? "ok" : `refused ${e.outcome}`)),
      el("td", { class: "detail" }, auditDetail(e)),
      el("td", { class: "muted small" }, e.request_id || "–"),
    ));
    if (!rows.length) {
      rows.push(el("tr", {}, el("td", { class: "empty", colspan: "7" }, "No admin actions yet.")));
    }
    $("audit-table").tBodies[0].replaceChildren(...rows);
  }

  // --- actions -------------------------------------------------------------------------------
  async function act(question, method, path, done) {
    if (question && !window.confirm(question)) return;
    try {
      const result = await api(method, path, method === "POST" ? {} : undefined);
      banner(done(result), "info");
      setTimeout(() => { if ($("banner").classList.contains("info")) banner(null); }, 6000);
    } catch (e) {
      fail(e, "Action failed");
    }
    await refresh(true);
  }

  $("promote").addEventListener("click", () => {
    const v = state.current && state.current.canary_version;
    if (v == null) return;
    act(`Promote canary v${v} to live for every user?`, "POST", `/admin/policies/${v}/promote`,
        (d) => `Promoted: v${d.live_version} is live.`);
  });
  $("rollback").addEventListener("click", () => {
    const d = state.current;
    const q = d && d.canary_version != null
      ? `Withdraw canary v${d.canary_version}? Its users go back to v${d.live_version}.`
      : "Roll back to the previous live version?";
    act(q, "POST", "/admin/rollback", (r) => `Rolled back: v${r.live_version} is live.`);
  });
  $("pause").addEventListener("click", () =>
    act(null, "POST", "/admin/training/pause", () => "Training paused."));
  $("resume").addEventListener("click", () =>
    act(null, "POST", "/admin/training/resume", () => "Training resumed."));

  $("window-select").addEventListener("change", () => {
    sessionStorage.setItem(WINDOW, $("window-select").value);
    refresh(true);
  });
  $("logout").addEventListener("click", () => {
    sessionStorage.removeItem(KEY);
    showLogin("Signed out.");
  });

  $("login-form").addEventListener("submit", async (ev) => {
    ev.preventDefault();
    const key = $("key-input").value.trim();
    if (!key) return;
    sessionStorage.setItem(KEY, key);
    $("login-button").disabled = true;
    try {
      await api("GET", "/admin/training");
      showApp();
    } catch (e) {
      sessionStorage.removeItem(KEY);
      showLogin(authMessage(e) || `Could not sign in: ${e.message}`);
    } finally {
      $("login-button").disabled = false;
    }
  });

  // start: straight to the dashboard when this tab already holds a key
  const savedWindow = sessionStorage.getItem(WINDOW);
  if (savedWindow) $("window-select").value = savedWindow;
  if (sessionStorage.getItem(KEY)) showApp(); else showLogin(null);
})();
