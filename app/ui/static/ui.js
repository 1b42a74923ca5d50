// The only script of the dashboard: reload a live overview, and show a tree node's text on click.
(function () {
  var facts = document.getElementById("facts");
  if (facts && facts.dataset.live === "yes") {
    setTimeout(function () { location.reload(); }, 5000);
  }
  var panel = document.getElementById("node-panel");
  if (!panel) return;
  document.querySelectorAll(".tree-node").forEach(function (node) {
    node.addEventListener("click", function () {
      document.querySelectorAll(".tree-node.selected").forEach(function (n) { n.classList.remove("selected"); });
      node.classList.add("selected");
      fetch("/groups/" + encodeURIComponent(panel.dataset.group) + "/nodes/" + node.dataset.nodeId)
        .then(function (r) { return r.text(); })
        .then(function (html) { panel.innerHTML = html; });
    });
  });
})();
