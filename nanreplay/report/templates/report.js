// nanreplay report: sortable tables and print-friendly <details>. Optional: the page reads fine without it.
(function () {
  "use strict";
  function key(cell, numeric) {
    var v = cell.getAttribute("data-v");
    if (v === null) { v = cell.textContent; }
    if (!numeric) { return v.toLowerCase(); }
    var f = parseFloat(v);
    return isNaN(f) ? -Infinity : f;
  }
  function sortBy(table, th, index) {
    var numeric = th.getAttribute("data-type") === "num";
    var dir = th.getAttribute("aria-sort") === "descending" ? 1 : -1;
    var heads = table.tHead.rows[0].cells;
    for (var h = 0; h < heads.length; h++) { heads[h].removeAttribute("aria-sort"); }
    th.setAttribute("aria-sort", dir === 1 ? "ascending" : "descending");
    var body = table.tBodies[0];
    var rows = Array.prototype.slice.call(body.rows);
    rows.sort(function (a, b) {
      var x = key(a.cells[index], numeric), y = key(b.cells[index], numeric);
      return (x < y ? -1 : x > y ? 1 : 0) * dir;
    });
    for (var r = 0; r < rows.length; r++) { body.appendChild(rows[r]); }
  }
  var tables = document.querySelectorAll("table.sortable");
  Array.prototype.forEach.call(tables, function (table) {
    if (!table.tHead || !table.tBodies.length) { return; }
    Array.prototype.forEach.call(table.tHead.rows[0].cells, function (th, i) {
      th.tabIndex = 0;
      th.title = "sort";
      th.addEventListener("click", function () { sortBy(table, th, i); });
      th.addEventListener("keydown", function (e) { if (e.key === "Enter") { sortBy(table, th, i); } });
    });
  });
  // Print everything: collapsed chain runs and tables open for printing, and close again after.
  var opened = [];
  window.addEventListener("beforeprint", function () {
    Array.prototype.forEach.call(document.querySelectorAll("details:not([open])"), function (d) {
      d.open = true; opened.push(d);
    });
  });
  window.addEventListener("afterprint", function () {
    opened.forEach(function (d) { d.open = false; });
    opened = [];
  });
})();
