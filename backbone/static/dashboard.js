// The backbone's dashboard (backbone/dashboard.py): polls /dashboard/data.json and redraws in place.
// Every string shown comes from the network and may be hostile (usernames are user input): the DOM is
// built with createElement/createElementNS and textContent only, never innerHTML.
"use strict";

(function () {
  const SVG = "http://www.w3.org/2000/svg";
  const TOKEN_KEY = "dedloc-admin-token";
  const params = new URLSearchParams(window.location.search);
  const poll = Math.max(500, Number(params.get("poll")) || 3000);
  let updates = 0;

  // An admin token given as #admin=TOKEN moves to this tab's storage and out of the address bar.
  if (window.location.hash.startsWith("#admin=")) {
    sessionStorage.setItem(TOKEN_KEY, decodeURIComponent(window.location.hash.slice(7)));
    history.replaceState(null, "", window.location.pathname + window.location.search);
  }

  function el(tag, text, cls) {
    const node = document.createElement(tag);
    if (text !== undefined && text !== null) node.textContent = String(text);
    if (cls) node.className = cls;
    return node;
  }

  function byId(id) { return document.getElementById(id); }

  function setText(id, text) { byId(id).textContent = text; }

  function fmt(value, digits) {
    if (value === null || value === undefined || Number.isNaN(value)) return "—";
    if (typeof value !== "number") return String(value);
    if (digits !== undefined) return value.toFixed(digits);
    return Number.isInteger(value) ? String(value) : value.toPrecision(4);
  }

  function bytes(value) {
    if (value === null || value === undefined) return "—";
    const units = ["B", "kB", "MB", "GB", "TB"];
    let i = 0;
    while (value >= 1000 && i < units.length - 1) { value /= 1000; i += 1; }
    return (i === 0 ? String(value) : value.toFixed(1)) + " " + units[i];
  }

  function ago(unix, now) {
    if (!unix) return "—";
    const s = Math.max(0, now - unix);
    if (s < 60) return Math.round(s) + " s ago";
    if (s < 3600) return Math.round(s / 60) + " min ago";
    if (s < 86400) return (s / 3600).toFixed(1) + " h ago";
    return (s / 86400).toFixed(1) + " d ago";
  }

  // A table of `rows` (arrays of [text, numeric]) under `headers`, replacing the children of `holder`.
  function table(holder, headers, rows, emptyText) {
    holder.replaceChildren();
    if (rows.length === 0) { holder.append(el("p", emptyText, "muted")); return; }
    const t = el("table");
    const head = el("tr");
    for (const [name, numeric] of headers) head.append(el("th", name, numeric ? "num" : ""));
    t.append(el("thead")); t.tHead.append(head);
    const body = el("tbody");
    for (const row of rows) {
      const tr = el("tr");
      row.forEach((cell, i) => tr.append(el("td", cell, headers[i][1] ? "num" : "")));
      body.append(tr);
    }
    t.append(body);
    holder.append(t);
  }

  function svgEl(tag, attrs, text) {
    const node = document.createElementNS(SVG, tag);
    for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, String(v));
    if (text !== undefined) node.textContent = text;
    return node;
  }

  // A line plot of `series` ([{points: [[x, y]...], cls}]) into the <svg> `svg` (viewBox 600x240).
  function plot(svg, series) {
    svg.replaceChildren();
    const W = 600, H = 240, L = 56, R = 10, T = 10, B = 26;
    const all = series.flatMap((s) => s.points).filter((p) => Number.isFinite(p[1]));
    if (all.length === 0) {
      svg.append(svgEl("text", { x: W / 2, y: H / 2, "text-anchor": "middle", class: "tick" }, "no data yet"));
      return;
    }
    let [x0, x1] = [Math.min(...all.map((p) => p[0])), Math.max(...all.map((p) => p[0]))];
    let [y0, y1] = [Math.min(...all.map((p) => p[1])), Math.max(...all.map((p) => p[1]))];
    if (x0 === x1) { x0 -= 1; x1 += 1; }
    if (y0 === y1) { y0 -= Math.abs(y0) * 0.1 || 1; y1 += Math.abs(y1) * 0.1 || 1; }
    const sx = (x) => L + ((x - x0) / (x1 - x0)) * (W - L - R);
    const sy = (y) => H - B - ((y - y0) / (y1 - y0)) * (H - T - B);
    svg.append(svgEl("line", { x1: L, y1: H - B, x2: W - R, y2: H - B, class: "axis" }));
    svg.append(svgEl("line", { x1: L, y1: T, x2: L, y2: H - B, class: "axis" }));
    for (const y of [y0, (y0 + y1) / 2, y1]) {
      svg.append(svgEl("text", { x: L - 4, y: sy(y) + 4, "text-anchor": "end", class: "tick" }, fmt(y)));
    }
    for (const x of [x0, x1]) {
      svg.append(svgEl("text", { x: sx(x), y: H - 8, "text-anchor": "middle", class: "tick" }, fmt(Math.round(x))));
    }
    for (const s of series) {
      const pts = s.points.filter((p) => Number.isFinite(p[1]));
      if (pts.length === 0) continue;
      const d = pts.map((p, i) => (i ? "L" : "M") + sx(p[0]).toFixed(1) + " " + sy(p[1]).toFixed(1)).join(" ");
      svg.append(svgEl("path", { d: d, class: "series " + (s.cls || "") }));
      if (pts.length === 1) svg.append(svgEl("circle", { cx: sx(pts[0][0]), cy: sy(pts[0][1]), r: 3, class: "series " + (s.cls || "") }));
    }
    svg.setAttribute("data-points", String(all.length));
  }

  function render(data) {
    const now = data.run.now;
    const s = data.summary;
    setText("run-id", data.run.run_id);
    setText("global-step", fmt(s.global_step));
    setText("loss", fmt(s.loss, 4));
    setText("samples-per-second", fmt(s.samples_per_second, 1));
    setText("active-peers", fmt(s.active_peers));
    setText("active-users", fmt(s.active_users));
    setText("dht-size", fmt(data.health.dht_size));
    const steps = data.steps;
    plot(byId("loss-plot"), [
      { points: steps.map((r) => [r.step, r.loss]) },
      { points: steps.map((r) => [r.step, r.eval_loss]), cls: "eval" },
    ]);
    plot(byId("rate-plot"), [{ points: steps.map((r) => [r.step, r.samples_per_second]) }]);
    const roles = Object.entries(s.roles).map(([k, v]) => v + " " + k).join(", ");
    const reach = Object.entries(s.reachability).map(([k, v]) => v + " " + k).join(", ");
    setText("roles", "roles: " + roles + (reach ? "; reachability: " + reach : "") +
      "; measured throughput " + fmt(s.measured_samples_per_second, 1) + " samples/s");

    const hidden = "per-user rows need the admin token (or a backbone started with --public-leaderboard)";
    if (data.peers === null) {
      table(byId("peers"), [], [], hidden);
    } else {
      table(byId("peers"),
        [["user"], ["peer"], ["roles"], ["device"], ["samples/s", true], ["upload", true], ["download", true], ["reachability"], ["since"]],
        data.peers.map((p) => [p.user, p.peer_id.slice(0, 12) + "…", p.roles.join(" + "), p.device || "—",
          fmt(p.samples_per_second, 1), p.upload_bps === null ? "—" : bytes(p.upload_bps) + "/s",
          p.download_bps === null ? "—" : bytes(p.download_bps) + "/s", p.reachability, ago(p.since, now)]),
        "no active peers");
    }
    if (data.leaderboard === null) {
      table(byId("leaderboard"), [], [], hidden);
    } else {
      table(byId("leaderboard"),
        [["#", true], ["user"], ["samples", true], ["compute h", true], ["online h", true], ["aggregated", true], ["relayed", true], ["peers", true], ["last seen"], ["flagged", true]],
        data.leaderboard.map((r, i) => [i + 1, r.user, fmt(r.samples), fmt(r.compute_hours, 2), fmt(r.online_hours, 2),
          bytes(r.bytes_aggregated), bytes(r.bytes_relayed), fmt(r.peers), ago(r.last_seen, now), fmt(r.flagged_reports)]),
        "no contributions yet");
    }
    table(byId("checkpoints"), [["step", true], ["saved"], ["size", true], ["sha256"]],
      data.checkpoints.map((c) => [fmt(c.step), ago(c.time, now), bytes(c.bytes), c.digest + "…"]),
      "no checkpoint stored yet");
    const h = data.health;
    const agg = h.aggregator;
    const relay = h.relay;
    table(byId("health"), [["what"], ["value", true]], [
      ["DHT size (estimate)", fmt(h.dht_size)],
      ["routing table", fmt(h.routing_table)],
      ["connected peers", fmt(h.connected_peers)],
      ["RPC latency (ms)", fmt(h.rpc_latency_ms, 1)],
      ["reports credited / flagged", fmt(s.reports.credited) + " / " + fmt(s.reports.flagged)],
      ["users / peers / open sessions", fmt(s.users) + " / " + fmt(s.peers) + " / " + fmt(s.open_sessions)],
      ["aggregator rounds aggregated / failed / no group", agg ? agg.rounds_aggregated + " / " + agg.rounds_failed + " / " + agg.no_group : "not aggregating"],
      ["aggregator errors", agg ? fmt(agg.errors) : "—"],
      ["relay reservations / circuits / relayed", relay ? relay.reservations + " / " + relay.circuits_granted + " / " + bytes(relay.bytes_relayed) : "not relaying"],
      ["backbone uptime", fmt(data.run.uptime_s / 3600, 2) + " h"],
    ], "");
    updates += 1;
    document.body.setAttribute("data-updates", String(updates));
    setText("status", "updated " + new Date(now * 1000).toLocaleTimeString() + " · every " + poll / 1000 + " s" +
      (data.access.per_user ? (data.access.public_leaderboard ? " · public leaderboard" : " · admin view") : " · public view"));
    byId("status").className = "muted";
  }

  async function refresh() {
    const token = sessionStorage.getItem(TOKEN_KEY);
    const headers = token ? { authorization: "Bearer " + token } : {};
    try {
      const response = await fetch("/dashboard/data.json", { headers: headers, cache: "no-store" });
      if (response.status === 401) {
        sessionStorage.removeItem(TOKEN_KEY);
        setText("status", "the admin token was refused; showing the public view");
        byId("status").className = "error";
        return;
      }
      if (!response.ok) throw new Error("HTTP " + response.status);
      render(await response.json());
    } catch (err) {
      setText("status", "cannot reach the backbone (" + err.message + "); retrying");
      byId("status").className = "error";
    }
  }

  function start() {
    byId("admin-form").addEventListener("submit", (event) => {
      event.preventDefault();
      const value = byId("admin-token").value.trim();
      if (value) sessionStorage.setItem(TOKEN_KEY, value);
      byId("admin-token").value = "";
      refresh();
    });
    byId("admin-forget").addEventListener("click", () => { sessionStorage.removeItem(TOKEN_KEY); refresh(); });
    refresh();
    window.setInterval(refresh, poll);
  }

  if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", start);
  else start();
})();
