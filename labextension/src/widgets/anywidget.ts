/**
 * What the notebook widgets use of anywidget's front-end API (https://anywidget.dev/en/afm/): a module's
 * default export `{ render({ model, el }) }`, whose return value anywidget calls when the view goes.
 * Typed here, not imported: anywidget's frontend loads the bundle and hands these in.
 */

export interface IModel {
  get(name: string): any;
  send(content: Record<string, unknown>): void;
  on(event: string, callback: () => void): void;
  off(event: string, callback: () => void): void;
  /** ipywidgets' manager of the model: a notebook's follows its session's kernel (`kernel`). */
  widget_manager?: { kernel?: IKernel | null };
}

/** What a view reads of the kernel its widget manager talks to (@jupyterlab/services' IKernelConnection). */
export interface IKernel {
  readonly id: string;
  readonly status: string;
  readonly isDisposed: boolean;
}

export interface IRenderProps {
  model: IModel;
  el: HTMLElement;
}

export interface IWidgetModule {
  render(props: IRenderProps): () => void;
}
