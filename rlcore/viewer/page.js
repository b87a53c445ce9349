var RolloutView = (function () {
  "use strict";
  var PAGE_SIZE = {{PAGE_SIZE}};
  var SVG = "http://www.w3.org/2000/svg";
  // shown columns: key, header, kind (int | num | text), digits for num
  var SHOWN = [
    ["step", "step", "int"], ["policy_version", "version", "int"], ["uid", "uid", "text"],
    ["prompt", "prompt", "text"], ["response", "response", "text"], ["ground_truth", "ground truth", "text"],
    ["reward", "reward", "num", 3], ["acc", "acc", "num", 3], ["advantage", "advantage", "num", 3],
    ["response_length", "length", "int"], ["log_prob", "log-prob", "num", 2]
  ];
  var RANGES = {step: "step", reward: "reward", len: "response_length"};  // filter name -> column
  var KEYS = ["q", "step_min", "step_max", "reward_min", "reward_max", "len_min", "len_max", "smooth"];
  var SMOOTHING = 0.6;  // the moving average's default weight (TensorBoard's)
  var rows = [], state = {sort: "step", desc: false, limit: PAGE_SIZE};

  function $(id) { return document.getElementById(id); }

  function number(text) {
    if (text === null || text === undefined || String(text).trim() === "") return null;
    var x = Number(text);
    return isFinite(x) ? x : null;
  }

  function kind(key) {
    for (var i = 0; i < SHOWN.length; i++) if (SHOWN[i][0] === key) return SHOWN[i][2];
    return null;
  }

  // the address: ?q=... and #q=... both work; the fragment wins
  function readAddress() {
    var p = new URLSearchParams(location.search);
    new URLSearchParams(location.hash.replace(/^#/, "")).forEach(function (v, k) { p.set(k, v); });
    KEYS.forEach(function (k) { $(k).value = p.has(k) ? p.get(k) : ""; });
    var sort = p.get("sort") || "step";
    var desc = sort.charAt(0) === "-";
    sort = desc ? sort.slice(1) : sort;
    state.sort = kind(sort) ? sort : "step";
    state.desc = desc && kind(sort) !== null;
    state.limit = PAGE_SIZE;
  }

  function writeAddress() {
    var p = new URLSearchParams();
    KEYS.forEach(function (k) { if ($(k).value.trim() !== "") p.set(k, $(k).value.trim()); });
    if (state.sort !== "step" || state.desc) p.set("sort", (state.desc ? "-" : "") + state.sort);
    var hash = p.toString();
    try {
      history.replaceState(null, "", hash ? "#" + hash : location.pathname + location.search);
    } catch (e) { /* some browsers refuse it for file:// pages: the view still works */ }
  }

  function filtered() {
    var q = $("q").value.trim().toLowerCase();
    var limits = Object.keys(RANGES).map(function (name) {
      return [RANGES[name], number($(name + "_min").value), number($(name + "_max").value)];
    });
    return rows.filter(function (r) {
      if (q && r._text.indexOf(q) < 0) return false;
      return limits.every(function (l) {
        var v = r[l[0]];
        if (l[1] !== null && !(v !== null && v >= l[1])) return false;
        return !(l[2] !== null && !(v !== null && v <= l[2]));
      });
    });
  }

  function compare(a, b) {
    var x = a[state.sort], y = b[state.sort];
    if (x === null || y === null) return x === y ? 0 : (x === null ? 1 : -1);  // empty cells last
    var c = typeof x === "string" ? x.localeCompare(y) : x - y;
    return state.desc ? -c : c;
  }

  function format(value, spec) {
    if (value === null || value === undefined) return "";
    if (spec[2] === "num") return value.toFixed(spec[3]);
    return String(value);
  }

  function renderTable(list) {
    var body = document.createElement("tbody");
    list.slice(0, state.limit).forEach(function (r) {
      var tr = document.createElement("tr");
      tr.dataset.step = r.step;
      SHOWN.forEach(function (spec) {
        var td = document.createElement("td");
        td.className = (spec[2] === "text" ? "text " : "num ") + spec[0];
        if (spec[0] === "response" && r._turns) {
          td.appendChild(turnsView(r._turns));
        } else if (spec[2] === "text") {
          var div = document.createElement("div");
          div.textContent = format(r[spec[0]], spec);  // text, never markup
          td.appendChild(div);
        } else {
          td.textContent = format(r[spec[0]], spec);
          if (spec[2] === "num" && r[spec[0]] !== null) td.title = String(r[spec[0]]);
        }
        tr.appendChild(td);
      });
      body.appendChild(tr);
    });
    var table = $("rows");
    table.replaceChild(body, table.tBodies[0]);
    Array.prototype.forEach.call(table.tHead.rows[0].cells, function (th) {
      if (th.dataset.key === state.sort) th.setAttribute("aria-sort", state.desc ? "descending" : "ascending");
      else th.removeAttribute("aria-sort");
    });
    var more = $("more"), left = list.length - Math.min(list.length, state.limit);
    more.hidden = left <= 0;
    more.textContent = "show " + Math.min(left, PAGE_SIZE) + " more (" + left + " not shown)";
  }

  // a tool-loop trajectory: one block per turn, its role (and tool name) above its text
  function turnsView(turns) {
    var div = document.createElement("div");
    turns.forEach(function (t) {
      var turn = document.createElement("div"), role = document.createElement("span");
      var name = String(t.role || "") + (t.name ? " " + t.name : "");
      turn.className = "turn " + String(t.role || "").replace(/[^a-z]/g, "");
      role.className = "role";
      role.textContent = name;
      turn.appendChild(role);
      turn.appendChild(document.createTextNode(String(t.content === null || t.content === undefined ? "" : t.content)));
      div.appendChild(turn);
    });
    return div;
  }

  function parseTurns(text) {
    if (!text) return null;
    try {
      var turns = JSON.parse(text);
      return Array.isArray(turns) && turns.length ? turns : null;
    } catch (e) { return null; }  // not JSON: the response text is shown instead
  }

  function svg(tag, attrs, parent) {
    var el = document.createElementNS(SVG, tag);
    Object.keys(attrs).forEach(function (k) { el.setAttribute(k, attrs[k]); });
    if (parent) parent.appendChild(el);
    return el;
  }

  function label(parent, x, y, text, anchor) {
    svg("text", {x: x, y: y, "text-anchor": anchor || "start"}, parent).textContent = text;
  }

  // mean of `key` per step over `list`: [[step, mean, count], ...] by step
  function perStep(list, key) {
    var acc = {};
    list.forEach(function (r) {
      if (r[key] === null) return;
      var a = acc[r.step] || (acc[r.step] = [0, 0]);
      a[0] += r[key];
      a[1] += 1;
    });
    return Object.keys(acc).map(Number).sort(function (a, b) { return a - b; }).map(function (s) {
      return [s, acc[s][0] / acc[s][1], acc[s][1]];
    });
  }

  // exponential moving average, debiased as TensorBoard does (the first points are not pulled towards 0):
  // a few samples a step make the raw means noise at a glance
  function movingAverage(values, weight) {
    var last = 0;
    return values.map(function (v, i) {
      last = last * weight + (1 - weight) * v;
      return last / (1 - Math.pow(weight, i + 1));
    });
  }

  function smoothing() {
    var w = number($("smooth").value);
    return w === null ? SMOOTHING : Math.min(Math.max(w, 0), 0.99);
  }

  function chart(list, key, name, cls, digits) {
    var W = 460, H = 170, L = 48, R = 12, T = 10, B = 24;
    var fig = document.createElement("figure"), cap = document.createElement("figcaption");
    var weight = smoothing();
    cap.textContent = "mean " + name + " per step, moving average " + weight;
    fig.appendChild(cap);
    var root = svg("svg", {width: W, height: H, viewBox: "0 0 " + W + " " + H, "class": cls, role: "img"}, fig);
    svg("title", {}, root).textContent = "mean " + name + " per step";
    var pts = perStep(list, key);
    if (!pts.length) { label(root, W / 2, H / 2, "no rows", "middle"); return fig; }
    var s0 = pts[0][0], s1 = pts[pts.length - 1][0];
    var ys = pts.map(function (p) { return p[1]; });
    var y0 = Math.min.apply(null, ys), y1 = Math.max.apply(null, ys);
    if (y0 === y1) { y0 -= 0.5; y1 += 0.5; }
    function px(s) { return s1 === s0 ? (L + W - R) / 2 : L + (s - s0) / (s1 - s0) * (W - L - R); }
    function py(v) { return T + (y1 - v) / (y1 - y0) * (H - T - B); }
    svg("line", {x1: L, y1: H - B, x2: W - R, y2: H - B, stroke: "#d0d7de"}, root);
    svg("line", {x1: L, y1: T, x2: L, y2: H - B, stroke: "#d0d7de"}, root);
    label(root, L - 4, T + 8, y1.toFixed(digits), "end");
    label(root, L - 4, H - B, y0.toFixed(digits), "end");
    label(root, L, H - 6, "step " + s0, "start");
    if (s1 !== s0) label(root, W - R, H - 6, "step " + s1, "end");
    svg("polyline", {"class": "raw", points: pts.map(function (p) { return px(p[0]) + "," + py(p[1]); }).join(" ")},
        root);
    var avg = movingAverage(ys, weight);
    var line = svg("polyline", {"class": "line", "data-values": avg.map(function (v) { return v.toFixed(6); }).join(" "),
                                points: pts.map(function (p, i) { return px(p[0]) + "," + py(avg[i]); }).join(" ")}, root);
    svg("title", {}, line).textContent = "moving average (smoothing " + weight + "): " +
        avg[avg.length - 1].toFixed(digits) + " at step " + s1;
    pts.forEach(function (p) {
      var c = svg("circle", {"class": "point", cx: px(p[0]), cy: py(p[1]), r: 2.5, "data-step": p[0]}, root);
      svg("title", {}, c).textContent = "step " + p[0] + ": " + p[1].toFixed(digits) + " (" + p[2] + " rows)";
    });
    return fig;
  }

  function render() {
    var list = filtered().sort(compare);
    $("count").textContent = list.length + " of " + rows.length + " rows";
    renderTable(list);
    var charts = $("charts");
    charts.textContent = "";
    charts.appendChild(chart(list, "reward", "reward", "reward", 3));
    charts.appendChild(chart(list, "response_length", "response length", "length", 2));
  }

  function update() { state.limit = PAGE_SIZE; writeAddress(); render(); }

  function start(data) {
    rows = data.rows.map(function (values, i) {
      var r = {};
      data.columns.forEach(function (c, j) { r[c] = values[j]; });
      r._text = [r.prompt, r.response, r.ground_truth].join("\n").toLowerCase();
      r._turns = parseTurns(r.turns);
      return r;
    });
    var head = $("rows").tHead.rows[0];
    SHOWN.forEach(function (spec) {
      var th = document.createElement("th");
      th.textContent = spec[1];
      th.dataset.key = spec[0];
      th.title = "sort by " + spec[1];
      th.addEventListener("click", function () {
        state.desc = state.sort === spec[0] ? !state.desc : false;
        state.sort = spec[0];
        writeAddress();
        render();
      });
      head.appendChild(th);
    });
    KEYS.forEach(function (k) { $(k).addEventListener("input", update); });
    $("filters").addEventListener("submit", function (e) { e.preventDefault(); });
    $("reset").addEventListener("click", function () {
      KEYS.forEach(function (k) { $(k).value = ""; });
      state.sort = "step";
      state.desc = false;
      update();
    });
    $("more").addEventListener("click", function () { state.limit += PAGE_SIZE; render(); });
    window.addEventListener("hashchange", function () { readAddress(); render(); });
    readAddress();
    render();
  }

  return {start: start};
})();
