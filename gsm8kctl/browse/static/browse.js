// Keyboard paging for reading many tapes: j = next, k = previous (outside text fields).
document.addEventListener("keydown", function (e) {
  if (e.altKey || e.ctrlKey || e.metaKey) return;
  var t = e.target;
  if (t && (t.tagName === "INPUT" || t.tagName === "SELECT" || t.tagName === "TEXTAREA")) return;
  var rel = e.key === "j" ? "next" : e.key === "k" ? "prev" : null;
  if (!rel) return;
  var a = document.querySelector('a[rel="' + rel + '"]');
  if (a) window.location.href = a.href;
});
